"""Build one rank's model shard from an engine config (seeded weights, a safetensors
checkpoint directory or a GGUF file)."""

from __future__ import annotations

import torch

from tspd_engine.config import EngineConfig
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.llama import LlamaModel
from tspd_engine.model.source import model_config, tensor_source
from tspd_engine.model.tp import ShardPlan, TpGroup
from tspd_engine.model.weights import random_source, shard_weights, weights_to
from tspd_serving.errors import ConfigError


def resolve_model(cfg: EngineConfig) -> ModelConfig:
    """The model config in force: the checkpoint's or GGUF file's (computed in
    ``cfg.model.dtype``) or ``cfg.model``; checks the context limit against it."""
    model = model_config(cfg.checkpoint, cfg.model.dtype) if cfg.checkpoint else cfg.model
    if cfg.max_model_len and cfg.max_model_len > model.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings "
            f"{model.max_position_embeddings}"
        )
    return model


def build_model(cfg: EngineConfig, tp: TpGroup) -> tuple[LlamaModel, ModelConfig]:
    """This rank's :class:`LlamaModel` (its TP shard) and the model config it was built for."""
    model_cfg = resolve_model(cfg)
    plan = ShardPlan.build(model_cfg, tp.rank, tp.size)
    if cfg.checkpoint:
        source = tensor_source(cfg.checkpoint, model_cfg)
    else:
        source = random_source(model_cfg, cfg.seed)
    device = torch.device(cfg.device)
    weights = weights_to(shard_weights(model_cfg, plan, source), device)
    return LlamaModel(model_cfg, plan, weights, tp, device), model_cfg
