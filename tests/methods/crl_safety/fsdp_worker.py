"""Worker of ``test_scale.py``: train CRL (or RR) a few steps on a tiny random Llama, under ``torchrun`` with FSDP2
over gloo ranks or as one plain process, and save the losses and the full adapter weights (rank 0)."""

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from reprlab.methods.crl_safety.chat import ChatFormat
from reprlab.methods.crl_safety.config import CrlCfg, DefenseCfg, LoraCfg, MiningCfg, OptimCfg, RrCfg, SftCfg
from reprlab.methods.crl_safety.scale import gather_twin, shard_model, sharded_twin
from reprlab.methods.crl_safety.trainer import Trainer
from reprlab.models.hf import tiny_llama
from reprlab.models.lora import add_lora
from reprlab.train.dist import init_distributed

# the reference code's CRL setting: raw states, L2 positives, batchmean KL on a retain set, no frozen cache
CODE = dict(
    cache_frozen=False,
    center_states=False,
    crl=CrlCfg(layers_benign="1:4", layers_harmful="2:4", d_pos="l2", margin_benign=2.0, margin_harmful=3.0,
               kl_reduction="batchmean", kl_data="retain"),
)  # fmt: skip

CASES = {
    # name: (kind, overrides); "crl_code" = the GPU recipes' settings: L2 positive, raw states, the code's KL
    # (batchmean on a retain set), no frozen cache; "crl_ours" = crl-tiny's: centred cosines, token-mean KL on the
    # benign batch, frozen cache
    "crl_code": ("crl", CODE),
    "crl_ours": (
        "crl",
        dict(cache_frozen=True, center_states=True, crl=CrlCfg(layers_benign="1:4", layers_harmful="2:4")),
    ),
    "rr": ("rr", dict(cache_frozen=False, center_states=True, crl=CrlCfg())),
    # the GPU recipes' setting: gradient checkpointing inside the FSDP units
    "crl_code_ckpt": ("crl", dict(CODE, ckpt=True)),
    # the latent attack trains on full batches, identically on every rank (no communication), and is always used
    "crl_adv": (
        "crl_adv",
        dict(cache_frozen=False, center_states=False, crl=CrlCfg(layers_benign="1:4", layers_harmful="2:4")),
    ),
    "sft": ("sft", dict(cache_frozen=True, center_states=False, crl=CrlCfg())),
}


def setup(case: str):
    kind, o = CASES[case]
    torch.set_num_threads(1)
    model, tok = tiny_llama(seed=0, num_hidden_layers=4, initializer_range=0.3)
    fmt = ChatFormat(tok, None, max_prompt_tokens=40)
    # prompts and replies of different lengths, so rows pad differently and ranks hold different token counts
    harm = [(fmt.prompt_ids(f"do bad thing {i}" + "!" * i), fmt.response_ids("x", "Sure, step " + "one " * (i % 3),
             end_turn=False)) for i in range(8)]  # fmt: skip
    ben = [(fmt.prompt_ids(f"nice question {i}" + "?" * (i % 4)), fmt.response_ids("x", "Here is " + "it " * i,
            end_turn=False)) for i in range(8)]  # fmt: skip
    optim = OptimCfg(steps=4, batch_size=4, lr=1e-2, log_every=1, checkpoint_every=100,
                     cache_frozen=o["cache_frozen"], gradient_checkpointing=o.get("ckpt", False))  # fmt: skip
    lora = LoraCfg(r=4, alpha=8, dropout=0.0)  # dropout masks would be drawn per rank
    if kind == "sft":
        cfg = SftCfg(optim=optim, lora=lora)
    else:
        cfg = DefenseCfg(optim=optim, lora=lora, center_states=o["center_states"], crl=o["crl"],
                         rr=RrCfg(layers="1,3", retain_layers="all"),
                         mining=MiningCfg(blocks="0:1", refresh_every=2, iterations=2, gate_loss=1e9, prob=1.0))  # fmt: skip
    torch.manual_seed(0)
    peft = add_lora(model, 4, 8, 0.0)
    return kind, peft, cfg, harm, ben, tok


class _Rec:
    """The slice of ``reprlab.runs.Run`` that ``Trainer.fit`` uses, recording the logged metrics."""

    logger = logging.getLogger("fsdp_worker")

    def __init__(self):
        self.rows = []

    def log(self, step, **metrics):
        self.rows.append(metrics)

    def checkpoints(self, tag):
        return []

    def save_checkpoint(self, *a, **k):
        return None

    save_sharded_checkpoint = save_checkpoint


def train(case: str, shard: bool | str) -> dict:
    """``Trainer.fit`` on ``case``; ``shard``: FSDP2 over the ranks, ``"twin"``: on the recipe's sharded twin (the
    model's frozen weights released while it trains, everything gathered back after), else plain replicas
    (gradients averaged)."""
    kind, peft, cfg, harm, ben, tok = setup(case)
    rec = _Rec()
    if shard == "twin":
        frozen = {n: p.detach().clone() for n, p in peft.named_parameters() if not p.requires_grad}
        twin = sharded_twin(peft)
        assert all(p.numel() == 0 for n, p in peft.named_parameters() if n in frozen)  # released
        Trainer(kind, twin, cfg, harm, ben, tok.pad_token_id, run=rec, seed=0, retain=ben).fit()
        gather_twin(twin, peft)
        assert not isinstance(peft, FSDPModule)
        for n, p in peft.named_parameters():  # whole tensors again, the frozen ones bit for bit
            assert not hasattr(p, "full_tensor") and (n not in frozen or torch.equal(p, frozen[n])), n
    else:
        if shard:
            shard_model(peft)
        Trainer(kind, peft, cfg, harm, ben, tok.pad_token_id, run=rec, seed=0, retain=ben).fit()
    state = {}
    for name, p in peft.named_parameters():
        if p.requires_grad:
            t = (
                p.full_tensor() if hasattr(p, "full_tensor") else p
            )  # FSDP2: a DTensor shard -> the whole tensor
            state[name] = t.detach().clone()
    return {"losses": [r[f"{kind}.loss"] for r in rec.rows], "state": state}


def resume_run(run_dir: str, out: str, kill_at: str, case: str) -> None:
    """``case`` for 4 steps in a real run folder (FSDP2 when under torchrun), checkpointing every 2 steps and
    resuming from the folder's latest checkpoint when it has one; ``kill_at`` > 0: every rank ends its process
    (``os._exit``, no clean-up) right after the checkpoint of that step. Rank 0 saves the adapters."""
    import os
    from dataclasses import dataclass, replace

    from reprlab.runs import Run

    @dataclass(frozen=True)
    class _Cfg:
        seed: int = 0

    info = init_distributed(device="cpu")
    kind, peft, cfg, harm, ben, tok = setup(case)
    cfg = replace(cfg, optim=replace(cfg.optim, steps=4, checkpoint_every=2))
    if info.enabled:
        shard_model(peft)
    resume = (Path(run_dir) / "checkpoints").exists()
    run = Run.create(run_dir, _Cfg(), "fsdp-resume", resume=resume, quiet=True)
    if info.enabled:
        dist.barrier()  # rank 0 has opened (or rewound) the folder before the others list its checkpoints
    save = run.save_sharded_checkpoint

    def save_then_die(step, *a, **k):
        folder = save(step, *a, **k)
        if step == int(kill_at):
            os._exit(0)  # as a kill right after the commit: no destroy_process_group, no later writes
        return folder

    run.save_sharded_checkpoint = save_then_die
    Trainer(kind, peft, cfg, harm, ben, tok.pad_token_id, run=run, seed=0, retain=ben).fit()
    state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in peft.named_parameters() if p.requires_grad}  # fmt: skip
    if info.is_main:
        torch.save({"world": info.world_size, "state": state}, out)
    if info.enabled:
        dist.barrier()
        dist.destroy_process_group()


def main(out: str, *cases: str) -> None:
    info = init_distributed(device="cpu")
    # "<case>@replicas": every rank holds the whole model and DDP averages the gradients (no FSDP); "<case>@twin":
    # the recipe's fsdp=true path (a sharded twin, gathered back)
    mode = {"replicas": False, "twin": "twin"}
    res = {
        c: train(c.split("@")[0], mode.get(c.partition("@")[2], True) if info.enabled else False)
        for c in cases
    }
    if info.is_main:
        torch.save({"world": info.world_size, **res}, out)
    if info.enabled:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        resume_run(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
