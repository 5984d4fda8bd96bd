"""The strategy's gradient hooks on parameters, kept after the user's own.

Autograd calls a parameter's post-accumulate-grad hooks in the order they were registered. The strategy's hook
starts averaging a bucket once the bucket's gradients are all there, so a hook of the user's that edits a gradient
(``p.grad = p.grad * 2``, ``p.grad.mul_(2)``) must run before it, or it edits a gradient already being sent.
:meth:`GradientHooks.put_last` re-registers each of the strategy's hooks that a hook registered since would follow:
at the first backward pass after hooks were added (the check reads torch's per-tensor hook dictionary, about
0.25 µs per parameter: not worth every pass), so hooks the user adds before training, after the strategy's setup
(in ``on_train_start``, after ``fabric.setup``), run first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

Hook = Callable[[torch.Tensor], None]


class GradientHooks:
    """Post-accumulate-grad hooks on parameters, each kept last among its parameter's (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: list[tuple[torch.Tensor, Hook, RemovableHandle]] = []
        self._checked = True

    def add(self, param: torch.Tensor, hook: Hook) -> None:
        """Call ``hook(param)`` once autograd has accumulated ``param``'s gradient."""
        self._entries.append((param, hook, param.register_post_accumulate_grad_hook(hook)))
        self._checked = False

    def put_last(self) -> None:
        """Before a backward pass: the first time since hooks were added, move each hook behind those registered on
        its parameter after it."""
        if self._checked:
            return
        self._checked = True
        for index, (param, hook, handle) in enumerate(self._entries):
            registered = getattr(param, "_post_accumulate_grad_hooks", None)
            if registered and next(reversed(registered)) != handle.id:
                handle.remove()
                self._entries[index] = (param, hook, param.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        """Remove every hook."""
        for _, _, handle in self._entries:
            handle.remove()
        self._entries = []
        self._checked = True
