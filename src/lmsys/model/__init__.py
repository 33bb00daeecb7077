"""The Transformer LM, its configuration and size presets."""

from lmsys.model.config import PRESETS, ModelConfig, config_from_yaml, get_config, parameter_count_formula

__all__ = ["PRESETS", "ModelConfig", "config_from_yaml", "get_config", "parameter_count_formula", "count_parameters"]


def count_parameters(config: ModelConfig) -> int:
    """Parameter count of the real module, built on the meta device: no memory is allocated."""
    import torch

    from lmsys.model.transformer import TransformerLM

    with torch.device("meta"):
        model = TransformerLM(config, device="meta")
    return sum(p.numel() for p in model.parameters())
