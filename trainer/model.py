"""The built-in task's model: a small decoder-only transformer language model (flax.linen)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import optax

from jaxrec.model.config import DataConfig, ModelConfig
from trainer.data import sequence_dataset
from trainer.task import TaskState


def compute_dtype(cfg: ModelConfig, platform: str) -> jnp.dtype:
    """The compute dtype: ``auto`` is bfloat16 on TPU and float32 elsewhere (CPU)."""
    if cfg.dtype == "auto":
        return jnp.bfloat16 if platform == "tpu" else jnp.float32
    return jnp.dtype(cfg.dtype)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    cfg: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """Apply the block to ``x`` of shape (batch, seq, d_model)."""
        h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.cfg.n_heads, dtype=self.dtype, deterministic=True, name="attn"
        )(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
        h = nn.Dense(self.cfg.d_ff, dtype=self.dtype, name="mlp_in")(h)
        h = nn.gelu(h)
        h = nn.Dense(self.cfg.d_model, dtype=self.dtype, name="mlp_out")(h)
        return x + h


class DecoderLM(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, a final norm, tied output projection."""

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits (float32) of shape (batch, seq, vocab) for integer ``tokens`` (batch, seq)."""
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, name="embed")
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))
        x = embed(tokens) + pos[None, : tokens.shape[1]]
        x = x.astype(self.dtype)
        mask = nn.make_causal_mask(tokens)
        for i in range(cfg.n_layers):
            x = Block(cfg, self.dtype, name=f"block_{i}")(x, mask)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
        return embed.attend(x.astype(jnp.float32))


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class LanguageModelTask:
    """The built-in ``lm`` task: ``DecoderLM`` trained by next-token cross-entropy on generated sequences.

    A batch is int32 tokens of shape (batch, seq_len + 1): inputs are the first ``seq_len``, targets
    the last ``seq_len``.
    """

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.model = DecoderLM(cfg, dtype=compute_dtype(cfg, jax.devices()[0].platform))

    def init(self, key: jax.Array) -> TaskState:
        """Parameters initialised from ``key``; no extra state."""
        return TaskState(self.model.init(key, jnp.zeros((1, self.cfg.seq_len), jnp.int32))["params"])

    def loss(self, params: Any, extra: Any, batch: jax.Array, key: jax.Array) -> tuple[jax.Array, Any]:
        """Mean next-token cross-entropy of ``batch``."""
        logits = self.model.apply({"params": params}, batch[:, :-1])
        return lm_loss(logits, batch[:, 1:]), extra

    def dataset(self, data: DataConfig) -> grain.MapDataset:
        """``data.num_records`` token sequences drawn from ``(data.seed, index)``."""
        return sequence_dataset(data, self.cfg.vocab_size, self.cfg.seq_len)
