"""The Transformer LM, its configuration and size presets (every tool builds the model through
`lmsys.train.build.build_model`)."""

from lmsys.model.config import PRESETS, ModelConfig, config_from_yaml, get_config, parameter_count_formula

__all__ = ["PRESETS", "ModelConfig", "config_from_yaml", "get_config", "parameter_count_formula", "describe"]


def describe(cfg: ModelConfig) -> str:
    """One line naming the shape of `cfg` (the meta line every report prints); a user's or Hugging Face's
    model: what it was built with, in its own names (lmsys.model.user.describe_user)."""
    from lmsys.model.user import describe_user, is_lmsys_model

    if not is_lmsys_model(cfg.model):
        return f"{cfg.model}" + (f" {cfg.model_kwargs}" if cfg.model_kwargs else "") + f": {describe_user(cfg)}"
    return (f"d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
            f"vocab {cfg.vocab_size}, context {cfg.context_length}")
