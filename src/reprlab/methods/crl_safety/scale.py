"""Scale: sharding the LoRA model over ranks (PyTorch FSDP2) and a peak-memory estimate per GPU.

Sharding: :func:`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to every decoder block and then to the
root (the unit layout accelerate's FSDP2 path uses for ``transformer_layer_cls_to_wrap``). Accelerate's own FSDP
switch is refused on CPU (``DistributedType.MULTI_CPU`` never becomes ``FSDP``), so we call the engine it wraps
directly; the same call runs on GPUs (NCCL) and is tested on CPU (gloo). The trainer then splits each global batch
over ranks (``trainer.py``).

Memory: :func:`memory_estimate` counts bytes from the architecture and the run config. It is an estimate, not a
measurement (no GPU here); the activation count lists the tensors autograd keeps per token and block in a Llama
layer with SDPA attention (no s x s matrix) and LoRA (checked against a measured block on CPU; CUDA kernels may
save a little more or less), and the rest are counts of parameters and tensors named in the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass


def shard_model(model, reshard_after_forward: bool = True, mixed_precision: bool | None = None):
    """FSDP2-shard a (peft) causal LM in place: one unit per decoder block, the rest (embeddings, head) at the root.

    Needs an initialised process group. Returns the same module (its class becomes ``FSDP<cls>``).

    Args:
        mixed_precision: compute in bf16 with fp32 gradient reduction (``MixedPrecisionPolicy(param_dtype=bf16,
            reduce_dtype=fp32)``); ``None`` = where the device supports it (CUDA with bf16), never on the CPU.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from reprlab.models.lora import _block_list

    if mixed_precision is None:
        dev = next(model.parameters()).device
        mixed_precision = dev.type == "cuda" and torch.cuda.is_bf16_supported()
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else None
    )
    kw = {"reshard_after_forward": reshard_after_forward, **({"mp_policy": mp} if mp is not None else {})}
    _, blocks = _block_list(model)
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def sharded_twin(model, release: bool = True):
    """An FSDP2-sharded twin of ``model`` to train, leaving ``model`` itself a plain module for what follows.

    The twin is a ``copy.deepcopy`` of the module tree whose memo maps every parameter and buffer to itself, so it
    copies no tensor; :func:`shard_model` then gives the twin its own shards (1/world of each weight per rank) and
    leaves ``model``'s tensors untouched. With ``release`` the whole-model weights are freed while the twin trains
    (each frozen parameter's storage becomes empty), so a rank holds 1/world of the weights as
    :func:`memory_estimate` counts; :func:`gather_twin` brings them back. Needs an initialised process group.

    Returns:
        the sharded twin (its parameter names are ``model``'s).
    """
    import copy

    import torch

    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    twin = shard_model(copy.deepcopy(model, memo))
    if release:
        for p in model.parameters():
            if not p.requires_grad:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return twin


def gather_twin(twin, model) -> None:
    """Copy the twin's trained parameters back into ``model``, gathered whole (a collective: every rank calls it,
    and every rank then holds the same full model). Frozen parameters that :func:`sharded_twin` released are
    gathered too (an all-gather copies bits, so they come back exactly); the others are left as they are."""
    import torch

    shards = dict(twin.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad or p.numel() == 0:
                t = shards[name]
                full = t.full_tensor() if hasattr(t, "full_tensor") else t
                if p.requires_grad:
                    p.copy_(full)
                else:
                    p.data = full.detach()


@dataclass(frozen=True)
class Arch:
    """The sizes of a Llama-family decoder that memory depends on."""

    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    d_vocab: int
    tied: bool = False

    @property
    def block_params(self) -> int:
        d, kv = self.d_model, self.d_model * self.n_kv_heads // self.n_heads
        return 2 * d * d + 2 * d * kv + 3 * d * self.d_ff + 2 * d  # q, o, k, v, gate/up/down, two norms

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.d_vocab * self.d_model
        return self.n_layers * self.block_params + self.d_vocab * self.d_model + head + self.d_model

    def lora_params_per_block(self, r: int) -> int:
        """LoRA A and B on the 7 projections (``all-linear``): r (d_in + d_out) each."""
        d, kv, f = self.d_model, self.d_model * self.n_kv_heads // self.n_heads, self.d_ff
        return r * (2 * (d + d) + 2 * (d + kv) + 3 * (d + f))

    def act_bytes_per_token_block(self, lora_dropout: bool, r: int = 16, bytes_act: int = 2) -> int:
        """Bytes autograd keeps per token in one block: HF Llama (SDPA attention, no s x s matrix) with peft LoRA on
        the 7 projections, bf16 base and fp32 adapters, as transformers 5.24 / peft 0.21 / torch 2.13 save them
        (counted with ``saved_tensors_hooks``; the test checks this count against a measured block).

        fp32: both RMSNorms' input and normalised copy (4 d), the LoRA branch's fp32 casts of the three distinct
        projection inputs (3 d) and of down_proj's input (d_ff); with dropout one more copy of each (3 d + d_ff).
        bf16: q and k after RoPE, k and v (2 d + 2 kv), the RoPE tables (2 d_head), gate, up and SiLU(gate)
        (3 d_ff). Small: LoRA A outputs (7 r fp32), attention log-sum-exp (n_heads fp32), one rsqrt.
        """
        d, kv, f = self.d_model, self.d_model * self.n_kv_heads // self.n_heads, self.d_ff
        d_head = self.d_model // self.n_heads
        fp32 = 4 * d + 3 * d + f + ((3 * d + f) if lora_dropout else 0)
        low = 2 * d + 2 * kv + 2 * d_head + 3 * f
        return 4 * fp32 + bytes_act * low + 4 * (7 * r + self.n_heads + 1)


ARCHS = {
    # config.json of meta-llama/Meta-Llama-3-8B-Instruct and mistralai/Mistral-7B-Instruct-v0.2
    "meta-llama/Meta-Llama-3-8B-Instruct": Arch(32, 4096, 14336, 32, 8, 128256),
    "mistralai/Mistral-7B-Instruct-v0.2": Arch(32, 4096, 14336, 32, 8, 32000),
}

GB = 1e9


def memory_estimate(
    cfg, arch: Arch, world: int = 1, kind: str = "crl", template_tokens: int = 32, fsdp: bool = True
) -> dict:
    """Peak bytes per GPU of one defence training step (``kind`` rr, crl or crl_adv), in GB (1e9 bytes).

    Args:
        cfg: the recipe ``Config`` (dtype, data lengths, ``defense``).
        world: ranks; each runs ``batch/world`` rows of every batch.
        fsdp: weights, adapters and AdamW sharded over the ranks (:func:`shard_model`); False = whole replicas
            (what ``reprlab run`` under torchrun does today).
        template_tokens: chat-template tokens around prompt and response (Llama-3: ~30).

    Returns:
        a dict of components and the totals with and without gradient checkpointing.
    """
    from reprlab.methods.crl_safety.trainer import lora_blocks, target_layers

    d = cfg.defense
    w_bytes = 2 if cfg.dtype == "bfloat16" else 4
    seq = cfg.data.max_prompt_tokens + cfg.data.response_tokens + template_tokens
    rows = d.optim.batch_size // world  # per rank, per class
    # CRL: harmful + benign + retain forward with grad in one graph; RR: harmful + retain
    passes = {"rr": 2, "crl": 3 if d.crl.kl_data == "retain" else 2}.get(kind, 3)
    tokens = passes * rows * seq
    n_lora_blocks = len(lora_blocks(d.lora.blocks, kind, d, arch.n_layers))
    lora = n_lora_blocks * arch.lora_params_per_block(d.lora.r)
    layers = target_layers(kind if kind != "crl_adv" else "crl", d, arch.n_layers)
    union = sorted(set().union(*layers.values()))
    out = {
        "seq_tokens": seq,
        "rows_per_rank": rows,
        "params_b": arch.params / 1e9,
        # FSDP keeps 1/world of the weights, plus the gathered block being computed and the next (prefetch) and the
        # root unit (embeddings + head) while it is in use
        "weights": arch.params * w_bytes / (world if fsdp else 1) / GB,
        "weights_gathered": (
            0.0
            if world == 1 or not fsdp
            else (2 * arch.block_params + 2 * arch.d_vocab * arch.d_model) * w_bytes / GB
        ),
        "lora_params_m": lora / 1e6,
        # fp32 adapters (peft upcasts), fp32 grads, AdamW's two fp32 moments: 16 bytes per parameter, sharded
        "lora_and_adamw": lora * 16 / (world if fsdp else 1) / GB,
    }
    per_tok = arch.act_bytes_per_token_block(d.lora.dropout > 0, d.lora.r)
    n_blocks = arch.n_layers
    # hidden states the losses read (output_hidden_states keeps every block output; they are the checkpoints too)
    hidden = tokens * (n_blocks + 1) * arch.d_model * w_bytes
    out["activations_full"] = (tokens * n_blocks * per_tok + hidden) / GB
    # checkpointing: block inputs kept (the hidden states above) + one block recomputed for all tokens at a time
    out["activations_ckpt"] = (hidden + tokens * per_tok) / GB
    # gathered states across ranks for the coupled terms: harmful (union of layers) and benign layers, trained
    # (with grad) and frozen, for the whole global batch
    nh = len(layers["harmful"]) if kind == "rr" else len(union)  # CRL's harmful pass reads the union
    nb = len(layers.get("benign", []))
    out["gathered_states"] = (
        0.0 if world == 1 else 2 * d.optim.batch_size * seq * (nh + nb) * arch.d_model * w_bytes / GB
    )
    # retain KL over every position: logits in the model dtype, frozen and trained, plus fp32 log-softmax of both
    # and the fp32 product (kl_data='retain'); with 'benign' only the response positions
    kl_pos = seq if d.crl.kl_data == "retain" else cfg.data.response_tokens + 1
    out["logits"] = rows * kl_pos * arch.d_vocab * (2 * w_bytes + 3 * 4) / GB if kind != "rr" else 0.0
    base = (
        out["weights"]
        + out["weights_gathered"]
        + out["lora_and_adamw"]
        + out["gathered_states"]
        + out["logits"]
    )
    out["total_no_ckpt"] = base + out["activations_full"]
    out["total_ckpt"] = base + out["activations_ckpt"]
    return out


def memory_table(cfg, arch: Arch, worlds=(1, 2, 4, 8), kind: str = "crl", fsdp: bool = True) -> list[dict]:
    """:func:`memory_estimate` rows for several world sizes, rounded to 0.1 GB."""
    rows = []
    for w in worlds:
        if cfg.defense.optim.batch_size % w:
            continue
        e = memory_estimate(cfg, arch, w, kind, fsdp=fsdp)
        rows.append(
            {"gpus": w, "fsdp": fsdp, **{k: round(v, 2) if isinstance(v, float) else v for k, v in e.items()}}
        )
    return rows


if __name__ == "__main__":  # python -m reprlab.methods.crl_safety.scale [recipe] [kind] [key=value ...]
    import sys

    from reprlab.recipes import get_recipe

    args = sys.argv[1:]
    name = args.pop(0) if args else "crl-llama3-8b"
    kind = args.pop(0) if args and "=" not in args[0] else "crl"
    cfg = get_recipe(name).build_config(args)
    for fsdp in (True, False):
        for row in memory_table(cfg, ARCHS[cfg.model], kind=kind, fsdp=fsdp):
            print(row)
