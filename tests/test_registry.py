"""One registry shape (issue 40 item 2): lmsys.core.registry.Registry of specs for attention, strategies and
models; lookups by name and import path, the miss hint, the listings; and no registered name tested with
`==` / `in (...)` outside its spec."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmsys.core.errors import LmsysError
from lmsys.core.registry import Registry, Spec

SRC = Path(__file__).resolve().parents[1] / "src" / "lmsys"


@dataclass(frozen=True)
class Thing(Spec):
    size: int = 0


def _things() -> Registry:
    r = Registry("thing", option="--thing", path_help="your thing",
                 from_path=lambda name: Thing(name, "yours", size=-1))
    r.add(Thing("small", "a small one", 1))
    r.add(Thing("large", "a large one", 3))
    return r


def test_registry_is_a_mapping_in_registration_order():
    r = _things()
    assert list(r) == ["small", "large"] and len(r) == 2 and "small" in r and r["large"].size == 3
    assert ", ".join(r) == "small, large" and r.names(lambda s: s.size > 1) == ("large",)
    r.add(Thing("small", "again", 2))  # a name registered again replaces its spec, in place
    assert list(r) == ["small", "large"] and r["small"].size == 2


def test_lookup_by_name_and_import_path():
    r = _things()
    assert r.lookup("small") is r["small"]
    mine = r.lookup("pkg.module:Name")
    assert mine == Thing("pkg.module:Name", "yours", size=-1) and "pkg.module:Name" not in r
    assert r.check("pkg.module:Name") == "pkg.module:Name" and r.check("large") == "large"
    assert r.lookup("path/to/file.py:Name").size == -1


def test_a_miss_names_every_known_name_and_hints_the_close_ones():
    r = _things()
    with pytest.raises(LmsysError) as exc:
        r.lookup("smal")
    assert str(exc.value) == "--thing must be one of small, large or pkg.module:Name, not 'smal'"
    assert "did you mean small?" in exc.value.hint
    with pytest.raises(LmsysError) as exc:
        r.check("zzz", what="config: thing")
    assert str(exc.value).startswith("config: thing must be one of small, large") and exc.value.hint is None


def test_listing_ends_with_the_import_path_row():
    r = _things()
    assert r.listing() == [("small", "a small one"), ("large", "a large one"), ("pkg.module:Name", "your thing")]
    assert r.listing(where=lambda s: s.size > 1, label=lambda s: s.help.upper()) == [
        ("large", "A LARGE ONE"), ("pkg.module:Name", "your thing")]


def test_a_registry_without_import_paths_refuses_them():
    r = Registry("thing", option="--thing", path_form=None)
    r.add(Thing("one", "one"))
    with pytest.raises(LmsysError, match=r"--thing must be one of one, not 'a.b:C'"):
        r.lookup("a.b:C")
    assert r.listing() == [("one", "one")]


def test_the_registries_load_without_torch():
    code = ("import sys, lmsys.core.registry, lmsys.kernels.registry, lmsys.kernels.requirements, "
            "lmsys.distributed.data_parallel.strategies, lmsys.model.user, lmsys.commands.listing; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- the three registries


def test_attention_specs():
    from lmsys.kernels import registry as attn
    from lmsys.kernels.attention import REPEAT_KV

    A = attn.ATTENTION
    assert isinstance(A, Registry) and all(isinstance(s, attn.AttentionSpec) for s in A.values())
    assert list(A) == ["naive", "compiled", "sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math",
                       "flash-torch", "flash-triton", "annotated", "yours-torch", "yours-triton"]
    # the old tables are views of the specs
    assert list(attn.NAMES) == list(A)[:10] and attn._PROVIDER == {"annotated": "lmsys.profiling.nvtx"}
    assert attn.ADAPTER_NAMES == {"yours-torch": "get_flashattention_autograd_function_pytorch",
                                  "yours-triton": "get_flashattention_autograd_function_triton"}
    assert REPEAT_KV == ("naive", "compiled", "annotated")
    assert A.names(lambda s: s.flash) == ("flash-torch", "flash-triton")
    assert A.names(lambda s: s.triton_kernel) == ("flash-triton",)
    assert A.names(lambda s: s.needs_triton) == ("flash-triton",) and A["flash-triton"].interpreter
    assert A.names(lambda s: s.may_ignore_causal) == ("yours-torch",)
    assert A.names(lambda s: s.runs_triton) == ("flash-triton", "yours-triton")
    assert A.names(lambda s: s.needs_cuda) == ("sdpa-flash", "sdpa-cudnn", "flash-triton")
    assert {n: A[n].scores for n in ("naive", "annotated", "compiled", "sdpa-math", "sdpa", "flash-triton")} == {
        "naive": "naive", "annotated": "naive", "compiled": "materialized", "sdpa-math": "materialized",
        "sdpa": "flash", "flash-triton": "flash"}
    assert A["yours-torch"].user and not A["flash-torch"].user
    mine = attn.spec("pkg.mod:Attn")  # a user's: [batch, seq, d], repeated shared heads, nothing loaded
    assert mine.user and not mine.grouped_query and mine.scores == "flash"
    assert A.lookup("pkg.mod:Attn") == mine
    with pytest.raises(LmsysError, match=r"yours-torch, yours-triton \(with --adapters\) or pkg.module:Name"):
        attn.check_name("bogus", what="--impl")
    with pytest.raises(LmsysError, match="add --adapters"):
        attn.check_name("yours-triton")


def test_plan_reads_the_scores_kind_from_the_spec():
    from lmsys.plan.shape import attention_kind

    assert [attention_kind(n) for n in ("naive", "annotated", "compiled", "sdpa-math", "sdpa-cudnn", "a.b:C")] == [
        "naive", "naive", "materialized", "materialized", "flash", "flash"]


def test_head_dims_and_devices_are_asked_of_the_spec():
    pytest.importorskip("triton")
    import torch

    from lmsys.kernels.registry import ATTENTION
    from lmsys.kernels.requirements import check_attention_impl

    with pytest.raises(LmsysError, match="head dim 12 is not supported"):
        ATTENTION["flash-triton"].check_head_dim(12)
    ATTENTION["flash-torch"].check_head_dim(12)
    check_attention_impl("naive", torch.device("cpu"))
    check_attention_impl(None, torch.device("cpu"))


def test_commands_common_reexports_the_requirements():
    from lmsys.commands import _common
    from lmsys.kernels import requirements

    assert _common.check_attention_impl is requirements.check_attention_impl
    assert _common.require_triton is requirements.require_triton


def test_strategy_specs():
    from lmsys.distributed.data_parallel import strategies as st

    S = st.STRATEGIES
    assert isinstance(S, Registry) and all(isinstance(s, st.Strategy) for s in S.values())
    assert list(S) == ["naive", "flat", "overlap", "bucketed", "torch-ddp", "fsdp", "torch-fsdp", "yours",
                       "yours-bucketed", "yours-fsdp", "yours-zero1"]
    assert {n: (S[n].shards_params, S[n].shards_optimizer) for n in (
        "naive", "bucketed", "fsdp", "torch-fsdp", "yours-zero1")} == {  # (params, optimizer state): ZeRO 0, 0, 3, 3, 1
        "naive": (False, False), "bucketed": (False, False), "fsdp": (True, False), "torch-fsdp": (True, False),
        "yours-zero1": (False, True)}
    assert S.names(lambda s: s.levers) == ("bucketed",) and S["bucketed"].levers == st.BUCKET_LEVERS
    assert S.names(lambda s: s.adapters) == S.names(lambda s: s.origin == "yours")
    assert S.names(lambda s: s.origin == "torch") == ("torch-ddp", "torch-fsdp")
    assert S.names(lambda s: s.first_cap_only) == ("yours-zero1",)
    assert st.get("bucketed") is S["bucketed"]
    with pytest.raises(LmsysError, match=r"--strategy must be one of naive, .* or pkg.module:Class, not 'zero3'"):
        st.check_name("zero3")
    with pytest.raises(LmsysError, match="add --adapters"):
        st.check_name("yours")
    assert st.listing()[-1][0] == "pkg.module:Class" and "(--adapters)" in dict(st.listing())["yours"]


def test_mesh_strategies_come_from_the_specs():
    pytest.importorskip("torch.distributed")
    from lmsys.distributed.parallelize import DP_STRATEGIES, HAND_WRITTEN_DP

    assert DP_STRATEGIES == ("bucketed", "fsdp", "torch-ddp", "torch-fsdp") and HAND_WRITTEN_DP == ("bucketed", "fsdp")


def test_model_specs():
    from lmsys.model import user

    M = user.MODELS
    assert isinstance(M, Registry) and list(M) == ["lmsys", "hf:llama", "hf:qwen2", "hf:mistral", "hf:gpt2"]
    assert M["lmsys"].build == "lmsys" and all(M[n].build == "hf" and M[n].hf == user.HF_MODELS[n]
                                               for n in user.HF_MODELS)
    assert user.is_lmsys_model(None) and user.is_lmsys_model("lmsys")
    assert not user.is_lmsys_model("hf:gpt2") and not user.is_lmsys_model("pkg.mod:GPT")
    assert user.model_spec("pkg.mod:GPT").build == "user" and user.check_model("pkg.mod:GPT") == "pkg.mod:GPT"
    with pytest.raises(LmsysError, match=r"--model must be lmsys, hf:llama, .* or pkg.module:Name, not 'hf:nope'"):
        user.check_model("hf:nope")
    assert user.listing()[0][0] == "lmsys" and user.listing()[-1][0] == "pkg.module:Name"


# ----------------------------------------------------------------------------- no name tested outside its spec


def _registered_names() -> set[str]:
    from lmsys.distributed.data_parallel.strategies import STRATEGIES
    from lmsys.kernels.registry import ATTENTION
    from lmsys.model.user import MODELS

    return set(ATTENTION) | set(STRATEGIES) | set(MODELS)


# Where the registries and their specs are defined: names are spelled there.
SPEC_FILES = {"core/registry.py", "kernels/registry.py", "distributed/data_parallel/strategies.py", "model/user.py"}
# Comparisons with a registered name's spelling that are another vocabulary's value (name -> why).
OTHER_VOCABULARIES = {
    "attention": "plan.shape.ModelShape.attention: how scores are held (naive | materialized | flash), "
                 "read from AttentionSpec.scores",
}
# (file, operand) pairs of another vocabulary that shares a spelling with a registered name
OTHER_IN_FILE = {
    ("bench/parallel.py", "impl"): "parallel train --impl: lmsys | torch, which implementation of the mesh runs",
}


def _strings(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _operand(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _operand(node.value)
    if isinstance(node, ast.Call):
        return _operand(node.func)
    return ""


def name_tests(tree: ast.AST, names: set[str], rel: str) -> list[str]:
    """`x == "naive"`, `x != "lmsys"`, `x in ("fsdp", ...)`, `"bucketed" in xs` for registered names."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.Eq, ast.NotEq)):
                pairs = [(left, right), (right, left)]
                hits = [(other, set(_strings(lit)) & names) for lit, other in pairs
                        if isinstance(lit, ast.Constant)]
            elif isinstance(op, (ast.In, ast.NotIn)):
                hits = [(left, set(_strings(right)) & names)] if isinstance(right, (ast.Tuple, ast.List, ast.Set)) \
                    else []
                if isinstance(left, ast.Constant):
                    hits.append((right, set(_strings(left)) & names))
            else:
                hits = []
            for other, matched in hits:
                operand = _operand(other)
                if not matched or operand in OTHER_VOCABULARIES or (rel, operand) in OTHER_IN_FILE:
                    continue
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            left = right
    return found


def test_the_scan_finds_name_tests():
    names = {"naive", "flash-triton", "lmsys", "bucketed"}
    code = ("a = impl == 'naive'\nb = 'lmsys' != cfg.model\nc = s in ('bucketed', 'x')\nd = 'bucketed' in strategies\n"
            "e = kind == 'gpipe'\nf = m.attention == 'naive'\ng = x.name in {'flash-triton'}\n")
    found = name_tests(ast.parse(code), names, "x.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        "impl == 'naive'", "'lmsys' != cfg.model", "s in ('bucketed', 'x')", "'bucketed' in strategies",
        "x.name in {'flash-triton'}"]


def test_no_registered_name_is_tested_outside_its_spec():
    names = _registered_names()
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in SPEC_FILES:
            continue
        found += name_tests(ast.parse(path.read_text()), names, rel)
    assert not found, "registered names tested outside their spec (ask the spec instead):\n" + "\n".join(found)
