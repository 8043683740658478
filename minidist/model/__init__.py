"""The model of the course: a config, its layers, and the decoder that puts them together."""

from minidist.model.config import PRESETS, ModelConfig, get_preset
from minidist.model.transformer import Transformer, build_model, lm_loss

__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "get_preset", "lm_loss"]
