"""Values a pipeline cut passes beside the activation (``StageLayout.side_values``): which module
outputs cross a cut, and the forward hook that keeps them on the sending stage and puts the
received tensors in place of a stand-in's NaN outputs on the receiving one (see
``nest_fx.graph.stage_modules``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Tuple, Dict

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from nest_fx.graph.stage_layout import StageLayout
from nest_fx.graph.stand_in import SplitError

if TYPE_CHECKING:  # the route is defined with the stages, which import this module
    from nest_fx.graph.stage_modules import StageRoute


def same_shape(old: torch.Tensor, new: torch.Tensor, path: str, seq_shards: int = 1) -> None:
    """Refuse a received tensor whose shape is not the one the model gives ``path`` here; with
    ``seq_shards`` > 1 the received tensor is one rank's part of dim 1 split ``seq_shards`` ways
    (``torch.chunk`` sizes, as a sequence-parallel shard: ``StageRoute.seq_shards``)."""
    expected = tuple(old.shape)
    if seq_shards > 1 and old.dim() > 1 and new.dim() == old.dim():
        sizes = {len(c) for c in torch.arange(old.shape[1]).chunk(seq_shards)} | {0}
        if new.shape[1] in sizes:
            expected = (old.shape[0], new.shape[1], *old.shape[2:])
    if expected != tuple(new.shape):
        raise SplitError(
            f"pipeline: the activation received for {path} has shape {tuple(new.shape)}, but the "
            f"model gives it {tuple(old.shape)}; the previous stage did not end where this one "
            "starts. fix: use pp=1"
        )


def _side_leaves(output: Any, count: int, path: str, layer_exit: bool) -> Tuple[List[Any], Any, List[int]]:
    """The positions, among the tensors of ``output`` (flattened), of the ``count`` that ``path``
    passes beside the activation: all of them, or all but the first when ``path`` is the layer
    whose first output is the activation itself. Returns (leaves, spec, positions)."""
    leaves, spec = tree_flatten(output)
    tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    if len(tensors) == count + 1 and layer_exit:
        tensors = tensors[1:]
    if len(tensors) != count:
        raise SplitError(
            f"pipeline: a cut passes {count} output tensors of {path} beside the activation, but it returns "
            f"{len(tensors)}; the stage cannot tell which to pass. fix: use pp=1"
        )
    return leaves, spec, tensors


def side_hook(route: "StageRoute", path: str, count_in: int, count_out: int, layer_exit: bool):
    """Forward hook on a module whose outputs cross the stage's cuts: replaces them by the tensors
    received from the previous stage (the module is a stand-in here), then keeps them to send on;
    a layer that passes on an earlier layer's value must return the very tensor it was given."""

    def hook(module, args, kwargs, output):
        if count_in:
            leaves, spec, positions = _side_leaves(output, count_in, path, layer_exit)
            received = route.side_received.pop(path, None)
            if received is None:
                raise SplitError(
                    f"pipeline stage [{route.start}, {route.end}): {path} ran twice or without the values "
                    "received for it; the model calls it more than once per forward. fix: use pp=1"
                )
            for i, new in zip(positions, received):
                same_shape(leaves[i], new, path)
                leaves[i] = new
            output = tree_unflatten(leaves, spec)
        if count_out:
            leaves, _, positions = _side_leaves(output, count_out, path, layer_exit)
            route.side_captured[path] = [leaves[i] for i in positions]
            given = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            if path in route.side_passed and any(id(t) not in given for t in route.side_captured[path]):
                raise SplitError(
                    f"pipeline: a cut passes on a value an earlier layer computed as an output of {path}, but "
                    f"{path} returns another tensor in its place; the next stage would read the wrong one. "
                    "fix: use pp=1"
                )
        return output

    return hook


def sent_sides(route: "StageRoute") -> List[torch.Tensor]:
    """The module outputs the stage passes beside its activation, contiguous, in the layout's order."""
    sent = []
    for path, _ in route.side_out:
        if path not in route.side_captured:
            raise SplitError(
                f"pipeline stage [{route.start}, {route.end}) stopped before {path} ran, whose output the next "
                "stage needs. fix: use pp=1"
            )
        sent.extend(t.contiguous() for t in route.side_captured[path])
    return sent


def side_groups(layout: StageLayout, cut: int) -> Tuple[Tuple[str, int], ...]:
    """The modules whose outputs cross ``cut`` beside the activation, each with how many."""
    counts: Dict[str, int] = {}
    for path, _, _, _ in layout.side_values.get(cut, ()):
        counts[path] = counts.get(path, 0) + 1
    return tuple(counts.items())


def passed_on(layout: StageLayout, cut: int) -> Tuple[str, ...]:
    """The layers whose outputs crossing ``cut`` are values they were given (``passed``)."""
    return tuple(dict.fromkeys(path for path, _, _, passed in layout.side_values.get(cut, ()) if passed))


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient of a received activation
    goes back to the previous stage by a point-to-point send, which takes contiguous tensors only
    (ConvNeXt's channels-last permute gives a strided one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()
