"""The graders against plausible wrong answers: each must be rejected with a hint that names its cause.

Each case replaces one function of the reference solution by a wrong answer a learner could write and runs the
chapter's grader on it (see wrong_answers.py). The test names carry no chapter number, so that `make grade CH=NN`,
which selects a chapter's graders by `-k chNN`, runs only the graders.
"""

import math
from collections import Counter
from unittest import mock

import pytest
import test_ch12
import test_ch14
import test_ch15
import test_ch16
import test_ch17
import torch
from torch.autograd.graph import GradientEdge
from wrong_answers import answers, rejects

from solutions import ch15_zero_bubble as s15
from solutions import ch16_mixed_precision as s16

E4M3 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------------------------
# The FP8 linear: a wrong scaling axis in any of its three GEMMs
# ---------------------------------------------------------------------------------------------------------------


def _q(t: torch.Tensor, dim: int | None, dtype: torch.dtype = E4M3) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (limit / amax.double().clamp(min=1e-12)).float()
    return (t * scale).clamp(-limit, limit).to(dtype).float() / scale


def _fp8_linear(fwd=(1, 1), dgrad=(1, 0), wgrad=(0, 0), grad_dtype=E4M3, quantize=True):
    """A rowwise FP8 linear with the axes (left operand's amax dim, right operand's) of each GEMM chosen."""
    def fp8_linear_rowwise(x, weight, grad_output):
        k, n = weight.shape[1], weight.shape[0]
        x2, dy2 = x.reshape(-1, k), grad_output.reshape(-1, n)
        q = _q if quantize else (lambda t, dim, dtype=E4M3: t)
        y = q(x2, fwd[0]) @ q(weight, fwd[1]).t()
        dx = q(dy2, dgrad[0], grad_dtype) @ q(weight, dgrad[1])
        dw = q(dy2, wgrad[0], grad_dtype).t() @ q(x2, wgrad[1])
        return y.reshape(*x.shape[:-1], n), dx.reshape(x.shape), dw
    return fp8_linear_rowwise


FP8_LINEAR_WRONG = {
    "forward's W reused for the input gradient": (_fp8_linear(dgrad=(1, 1)), "the forward's quantized W reused"),
    "forward's x reused for the weight gradient": (_fp8_linear(wgrad=(0, 1)), "the forward's quantized x reused"),
    "dgrad's dy reused for the weight gradient": (_fp8_linear(wgrad=(1, 0)), "the input gradient's quantized dy"),
    "x scaled per feature in the forward": (_fp8_linear(fwd=(0, 1)), "x scaled per feature"),
    "dy scaled per feature in dgrad": (_fp8_linear(dgrad=(0, 0)), "dy scaled per feature"),
    "one scale per tensor": (_fp8_linear(fwd=(None, None), dgrad=(None, None), wgrad=(None, None)),
                             "one scale per tensor"),
    "not quantized": (_fp8_linear(quantize=False), "it equals the fp32 product"),
    "e5m2 gradient": (_fp8_linear(grad_dtype=torch.float8_e5m2), "cast to e5m2"),
}


@pytest.mark.parametrize("case", list(FP8_LINEAR_WRONG))
def test_fp8_linear_grader_names_the_wrong_axis(case: str) -> None:
    wrong, hint = FP8_LINEAR_WRONG[case]
    rejects(test_ch16.test_ch16_fp8_linear_rowwise, answers("ch16_mixed_precision", fp8_linear_rowwise=wrong), hint)


def test_fp8_linear_grader_accepts_the_fused_product_order() -> None:
    """A right answer written another way (scales applied after the matmul, 3-D kept) passes."""
    def other_order(x, weight, grad_output):
        def qs(t, dim):
            limit = torch.finfo(E4M3).max
            scale = (limit / t.abs().amax(dim=dim, keepdim=True).double().clamp(min=1e-12)).float()
            return (t * scale).clamp(-limit, limit).to(E4M3).float(), scale
        k, n = weight.shape[1], weight.shape[0]
        x2, dy2 = x.reshape(-1, k), grad_output.reshape(-1, n)
        (xa, sxa), (wa, swa) = qs(x2, 1), qs(weight, 1)
        y = (xa @ wa.t()) / (sxa * swa.t())
        (da, sda), (wb, swb) = qs(dy2, 1), qs(weight, 0)
        dx = (da @ wb) / (sda * swb)
        (dc, sdc), (xc, sxc) = qs(dy2, 0), qs(x2, 0)
        dw = (dc.t() @ xc) / (sdc.t() * sxc)
        return y.reshape(*x.shape[:-1], n), dx.reshape(x.shape), dw
    test_ch16.test_ch16_fp8_linear_rowwise(answers("ch16_mixed_precision", fp8_linear_rowwise=other_order))


# ---------------------------------------------------------------------------------------------------------------
# The block quantizer: each wrong axis or count named
# ---------------------------------------------------------------------------------------------------------------


def _blocks_swapped(x, rows, cols):
    return s16.quantize_blocks(x, cols, rows)


def _blocks_whole_only(x, rows, cols):
    return s16.quantize_blocks(x[: x.shape[0] // rows * rows, : x.shape[1] // cols * cols], rows, cols)


def _blocks_inverted_scale(x, rows, cols):
    data, scales = s16.quantize_blocks(x, rows, cols)
    return data, 1 / scales


def _blocks_tensor_scale(x, rows, cols):
    data, scales = s16.quantize_blocks(x, rows, cols)
    scale = 448.0 / float(x.abs().max())
    return (x * scale).clamp(-448, 448).to(E4M3), torch.full_like(scales, scale)


def _blocks_mixed_view(x, rows, cols):
    limit = 448.0
    padded = torch.nn.functional.pad(x.abs(), (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))
    amax = padded.reshape(padded.shape[0] // rows, cols, padded.shape[1] // cols, rows).amax(dim=(1, 3))
    scales = (limit / amax.double().clamp(min=1e-12)).float()
    spread = scales.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: x.shape[0], : x.shape[1]]
    return (x * spread).clamp(-limit, limit).to(E4M3), scales


BLOCKS_WRONG = {
    "rows and cols swapped": (_blocks_swapped, "rows and cols swapped"),
    "partial blocks dropped": (_blocks_whole_only, "partial blocks at the edges are missing"),
    "amax / 448": (_blocks_inverted_scale, "448 / amax, not amax / 448"),
    "the tensor's scale everywhere": (_blocks_tensor_scale, "the whole tensor's scale"),
    "rows and cols exchanged in the view": (_blocks_mixed_view, "view it as (R/rows, rows, C/cols, cols)"),
}


@pytest.mark.parametrize("case", list(BLOCKS_WRONG))
def test_block_grader_names_the_cause(case: str) -> None:
    wrong, hint = BLOCKS_WRONG[case]
    rejects(test_ch16.test_ch16_quantize_blocks, answers("ch16_mixed_precision", quantize_blocks=wrong), hint)


def test_dequantize_grader_sees_a_multiplied_scale() -> None:
    def times(data, scales, rows, cols):
        return data.float() * s16.dequantize_blocks(torch.ones_like(data.float()).to(E4M3), scales, rows, cols) ** -1
    rejects(test_ch16.test_ch16_quantize_blocks, answers("ch16_mixed_precision", dequantize_blocks=times),
            "divide each element by its own block's scale")


# ---------------------------------------------------------------------------------------------------------------
# Chapters 12, 14, 17: the hints that were missing or wrong
# ---------------------------------------------------------------------------------------------------------------


IN_FLIGHT_WRONG = {
    "no cap at m": (lambda pp, m, stage: pp - stage, "cap the count at m"),
    "warm-up only": (lambda pp, m, stage: min(pp - stage - 1, m), "warm-up forwards alone"),
    "stages reversed": (lambda pp, m, stage: min(stage + 1, m), "stages counted from the wrong end"),
    "AFAB": (lambda pp, m, stage: m, "that is AFAB"),
}


@pytest.mark.parametrize("case", list(IN_FLIGHT_WRONG))
def test_in_flight_grader_names_the_cause(case: str) -> None:
    wrong, hint = IN_FLIGHT_WRONG[case]
    rejects(test_ch12.test_ch12_in_flight_1f1b, answers("ch12_five_dimensions", in_flight_1f1b=wrong), hint)


def _flagged(order: str):
    """first_flagged walking `got`'s order, or returning the largest error."""
    def first_flagged(got, want, tol):
        rows = []
        for name in (got if order == "got" else want):
            if name not in got or name not in want:
                return name, math.inf
            rel = (got[name].double() - want[name].double()).norm().item() / want[name].double().norm().item()
            rows.append((name, rel))
        over = [(n, r) for n, r in rows if r > tol]
        if not over:
            return None
        return max(over, key=lambda nr: nr[1]) if order == "largest" else over[0]
    return first_flagged


@pytest.mark.parametrize(("order", "hint"), [("got", "walk `want`'s order"), ("largest", "the largest error")])
def test_first_flagged_grader_names_the_order(order: str, hint: str) -> None:
    grads = test_ch14.grads.__wrapped__()
    rejects(test_ch14.test_ch14_first_flagged, answers("ch14_debugging", first_flagged=_flagged(order)), hint, grads)


def _pair_picker(rule: str):
    def most_frequent_pair(words, ids):
        pairs: Counter = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        if not pairs:
            return None
        if rule == "sennrich":
            return max(pairs, key=pairs.get)  # Sennrich et al.'s reference: the first pair seen wins a tie
        top = max(pairs.values())
        tied = [p for p, c in pairs.items() if c == top]
        keys = {"strings": lambda p: p, "sum": lambda p: ids[p[0]] + ids[p[1]],
                "right first": lambda p: (ids[p[1]], ids[p[0]]), "largest": lambda p: (-ids[p[0]], -ids[p[1]])}
        return min(tied, key=keys[rule])
    return most_frequent_pair


TIE_BREAKS = [("sennrich", "the first pair seen"), ("strings", "smallest pair of strings"), ("sum", "not their sum"),
              ("right first", "nor the right first"), ("largest", "take the smallest")]


@pytest.mark.parametrize(("rule", "hint"), TIE_BREAKS)
def test_most_frequent_pair_grader_names_the_tie_break(rule: str, hint: str) -> None:
    rejects(test_ch17.test_ch17_most_frequent_pair_breaks_ties_by_ids,
            answers("ch17_data", most_frequent_pair=_pair_picker(rule)), hint)


# ---------------------------------------------------------------------------------------------------------------
# Chapter 15: the frontier capture
# ---------------------------------------------------------------------------------------------------------------


def _simple_input(output, grad, x, weights):
    """The simple way's B: autograd.grad for x, keeping the graph; W will walk it again."""
    (dx,) = torch.autograd.grad([output], [x], [grad], retain_graph=True)
    return dx, {"output": output, "grad": grad, "weights": weights}


def _simple_weight(captured):
    """The simple way's W: a second backward from the block's output; right values, the input's path runs twice."""
    torch.autograd.backward([captured["output"]], [captured["grad"]], inputs=captured["weights"], retain_graph=True)


def _one_call_weight(captured):
    """All frontier edges in one backward call, every weight as inputs."""
    edges, grads, weights = [], [], []
    for node, (received, branch) in captured.items():
        weights += branch
        for i, g in enumerate(received):
            if g is not None:
                edges.append(GradientEdge(node, i))
                grads.append(g)
    torch.autograd.backward(edges, grads, inputs=weights, retain_graph=True)


def _input_with_weights(output, grad, x, weights):
    """B that computes the weights' gradients too (a fused backward called B)."""
    dx, captured = s15.frontier_backward_input(output, grad, x, weights)
    torch.autograd.backward([output], [grad], inputs=list(weights), retain_graph=True)
    return dx, captured


def _no_retain(output, grad, x, weights):
    """B without retain_graph: W finds the graph freed."""
    real = torch.autograd.grad

    def freeing(*args, **kwargs):
        return real(*args, **{**kwargs, "retain_graph": False})

    with mock.patch("torch.autograd.grad", freeing):
        return s15.frontier_backward_input(output, grad, x, weights)


def _overwrite_weight(captured):
    """W that sets .grad instead of adding to it."""
    for _, (_, branch) in captured.items():
        for w in branch:
            w.grad = None
    s15.frontier_backward_weight(captured)


FRONTIER_WRONG = {
    "the simple way": ({"frontier_backward_input": _simple_input, "frontier_backward_weight": _simple_weight},
                       "ran again in W"),
    "W overwrites .grad": ({"frontier_backward_weight": _overwrite_weight}, "did W add to .grad"),
    "one backward call for every frontier": ({"frontier_backward_weight": _one_call_weight}, "one backward call"),
    "B computes the weight gradients": ({"frontier_backward_input": _input_with_weights}, "after B"),
    "B frees the graph": ({"frontier_backward_input": _no_retain}, "retain_graph=True"),
}


@pytest.mark.parametrize("case", list(FRONTIER_WRONG))
def test_frontier_grader_names_the_cause(case: str) -> None:
    wrong, hint = FRONTIER_WRONG[case]
    rejects(test_ch15.test_ch15_frontier_split, answers("ch15_zero_bubble", **wrong), hint, torch.tanh)


def test_e4m3_cast_saturates_so_a_missing_clamp_cannot_be_graded() -> None:
    """quantize_e4m3's docstring says the grader cannot see a missing clamp: torch's e4m3 cast saturates by itself.
    Should that change, a missing clamp becomes visible (inf or NaN), and the grader should grade it."""
    cast = torch.tensor([1e6, -1e6, float("inf")]).to(E4M3).float().tolist()
    assert cast == [448.0, -448.0, 448.0], f"torch's e4m3 cast no longer saturates ({cast}): grade the clamp"
    no_clamp = answers("ch16_mixed_precision", quantize_e4m3=lambda x: (
        (x * (448.0 / x.abs().max().clamp(min=1e-12))).to(E4M3), 448.0 / x.abs().max().clamp(min=1e-12)))
    test_ch16.test_ch16_quantize_e4m3(no_clamp)  # passes, as the docstring says
