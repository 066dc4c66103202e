"""Hook context managers, ``run_with_cache`` and activation patching on named hook sites.

Usage (any model that :mod:`reprlab.hooks.sites` understands)::

    logits, cache = run_with_cache(model, ids, names=["blocks.1.hook_resid_post"])
    with patch(model, {"blocks.0.mlp.hook_post": patch_positions(source_act, positions=[9])}):
        patched_logits = model(ids)

A hook function has the signature ``fn(activation, name) -> Tensor | None``; returning a tensor replaces
the activation downstream, returning ``None`` leaves it unchanged. All hooks are removed when the context
exits, also on exceptions, so a failed experiment cannot leave a model silently patched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from reprlab.hooks.sites import resolve

HookFn = Callable[[Tensor, str], Tensor | None]


def _register(model: nn.Module, name: str, fn: HookFn):
    site = resolve(model, name)
    if site.kind == "output":

        def out_hook(_module, _args, output):
            tensor = output[0] if isinstance(output, tuple) else output
            new = fn(tensor, name)
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return site.module.register_forward_hook(out_hook)

    def call(x: Tensor) -> Tensor | None:
        if site.heads is None:
            return fn(x, name)
        # concatenated heads (batch, pos, heads * d_head): hooks see and return (batch, pos, heads, d_head);
        # the view itself flows on, so a cached view is in the graph and receives gradients
        view = x.unflatten(-1, (site.heads, -1))
        new = fn(view, name)
        return (view if new is None else new).flatten(-2)

    def pre_hook(_module, args, kwargs):
        if args:
            new = call(args[0])
            return None if new is None else ((new, *args[1:]), kwargs)
        new = call(kwargs["hidden_states"])
        return None if new is None else (args, {**kwargs, "hidden_states": new})

    return site.module.register_forward_pre_hook(pre_hook, with_kwargs=True)


@contextmanager
def hooks(model: nn.Module, fwd_hooks: Mapping[str, HookFn] | Iterable[tuple[str, HookFn]]) -> Iterator[None]:
    """Attach forward hooks by name for the duration of the block (several per name allowed)."""
    items = fwd_hooks.items() if isinstance(fwd_hooks, Mapping) else fwd_hooks
    handles = []
    try:
        for name, fn in items:
            handles.append(_register(model, name, fn))
        yield
    finally:
        for h in handles:
            h.remove()


class Cache(dict):
    """Activations by hook name, each (batch, pos, ...). ``stack(names)`` stacks them on a new dim 0."""

    def stack(self, names: list[str]) -> Tensor:
        return torch.stack([self[n] for n in names])


def run_with_cache(
    model: nn.Module, *args, names: list[str], detach: bool = True, **kwargs
) -> tuple[object, Cache]:
    """Run ``model(*args, **kwargs)`` and record the named activations.

    Args:
        names: hook names to record.
        detach: detach cached tensors (default). With ``detach=False`` they stay in the autograd graph
            and ``retain_grad()`` is called, so ``cache[name].grad`` is filled by a later backward pass
            (what attribution patching needs).

    Returns:
        ``(model output, Cache)``.
    """
    cache = Cache()

    def save(act: Tensor, name: str) -> None:
        if detach:
            cache[name] = act.detach()
        else:
            if act.requires_grad:
                act.retain_grad()
            cache[name] = act

    with hooks(model, [(n, save) for n in names]):
        out = model(*args, **kwargs)
    return out, cache


def replace_with(value: Tensor) -> HookFn:
    """Hook that replaces the whole activation with ``value`` (broadcast to its shape)."""

    def fn(act: Tensor, _name: str) -> Tensor:
        return value.to(act.dtype).expand_as(act).clone()

    return fn


def patch_positions(
    source: Tensor, positions: Tensor | list[int] | None = None, index: Tensor | list[int] | None = None
) -> HookFn:
    """Hook that copies ``source`` into the activation at the given positions and last-dim indices.

    Args:
        source: (batch, pos, ...) activation from the source run (or broadcastable to the target).
        positions: sequence positions to patch; all when None.
        index: indices along the last dim (neurons, heads for ``hook_z`` use dim -2 via a custom fn);
            all when None.
    """

    def fn(act: Tensor, _name: str) -> Tensor:
        out = act.clone()
        src = source.to(act.dtype).expand_as(act)
        pos = slice(None) if positions is None else torch.as_tensor(positions, device=act.device)
        if index is None:
            out[:, pos] = src[:, pos]
        else:
            idx = torch.as_tensor(index, device=act.device)
            sub_out = out[:, pos]
            sub_out[..., idx] = src[:, pos][..., idx]
            out[:, pos] = sub_out
        return out

    return fn


@contextmanager
def patch(model: nn.Module, patches: Mapping[str, HookFn | Tensor]) -> Iterator[None]:
    """Activation patching: within the block, each named activation is replaced.

    Values may be a hook function (see :func:`patch_positions`) or a tensor that replaces the activation
    (broadcast). Equivalent to :func:`hooks` with :func:`replace_with` for tensors.
    """
    fns = {n: (replace_with(v) if isinstance(v, Tensor) else v) for n, v in patches.items()}
    with hooks(model, fns):
        yield
