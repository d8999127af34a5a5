"""A small decoder-only transformer language model (flax.linen) and its AdamW optimizer."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from recovery_steps.kernel.config import ModelConfig, OptimizerConfig


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


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay, after global-norm gradient clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.end_learning_rate_fraction,
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
