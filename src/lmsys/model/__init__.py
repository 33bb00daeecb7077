"""The Transformer LM, its configuration and size presets."""

from lmsys.model.config import PRESETS, ModelConfig, config_from_yaml, get_config, parameter_count_formula

__all__ = ["PRESETS", "ModelConfig", "config_from_yaml", "get_config", "parameter_count_formula", "count_parameters",
           "describe"]


def describe(cfg: ModelConfig) -> str:
    """One line naming the shape of `cfg` (the meta line every report prints)."""
    model = "" if cfg.model == "lmsys" else f"{cfg.model}" + (f" {cfg.model_kwargs}" if cfg.model_kwargs else "") + ": "
    return (f"{model}d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
            f"vocab {cfg.vocab_size}, context {cfg.context_length}")


def count_parameters(config: ModelConfig) -> int:
    """Parameter count of the real module, built on the meta device: no memory is allocated."""
    import torch

    if config.model != "lmsys":
        from lmsys.model.user import count_parameters as count_user

        return count_user(config)

    from lmsys.model.transformer import TransformerLM

    with torch.device("meta"):
        model = TransformerLM(config, device="meta")
    return sum(p.numel() for p in model.parameters())
