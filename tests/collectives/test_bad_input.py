"""Bad input on one rank raises on every rank, at 2 and 3 ranks: caught (the ranks stay in step) and not caught
(the job ends). The cases are in bad_inputs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mpistrategy as ms
from mpistrategy import CommunicationError
from mpistrategy.collectives import _p2p_wire, p2p
from tests.collectives.bad_inputs import CASES, STARTED, UNCAUGHT, culprit, left, rank, right, size
from tests.external_job import run_mpi_job

SCRIPT = Path(__file__).parent / "bad_inputs.py"
UNCAUGHT_SECONDS = 30.0


def _message(error: BaseException) -> str:
    """What a user reads: the message and its notes."""
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


def _assert_in_step() -> None:
    """The next collectives and messages pair as they should and return the right values."""
    total = ms.allreduce(torch.full((3,), float(rank() + 1)))
    assert torch.equal(total, torch.full((3,), size() * (size() + 1) / 2))
    root = size() - 1
    value = ms.broadcast(torch.arange(4.0) * root if rank() == root else None, root=root)
    assert torch.equal(value, torch.arange(4.0) * root)
    received = ms.sendrecv(torch.full((2,), float(rank())), right(rank()), left(rank()), tag=3)
    assert torch.equal(received, torch.full((2,), float(left(rank()))))
    p2p.wait_backward_sends()
    assert not _p2p_wire.arriving and not _p2p_wire.detached_sends


@pytest.mark.mpi(ranks=(2, 3))
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_on_one_rank_raises_on_every_rank(name: str) -> None:
    case = CASES[name]
    bad = rank() == culprit()
    if rank() in case.raisers():
        expected = case.error if bad else CommunicationError
        with pytest.raises(expected) as caught:
            case.call(bad)
        text = _message(caught.value)
        assert case.op in text and f"rank {culprit()}" in text, text
    else:  # point-to-point: a rank the culprit sends nothing to gets its own message (if any) as usual
        result = case.call(bad)
        assert result is None or torch.equal(result, torch.ones(2 * size()))
    _assert_in_step()


@pytest.mark.mpi(ranks=(2, 3))
def test_sendrecv_with_an_invalid_src_tells_dst() -> None:
    """The culprit names no valid source: its dst learns of the error; the message its left neighbour sent it stays
    unreceived (nobody can tell whom it was for), and its next receive from that neighbour gets it."""
    x = torch.full((2,), float(rank()))
    if rank() == culprit():
        with pytest.raises(ValueError, match=f"src={size()} is not a rank") as caught:
            ms.sendrecv(x, right(rank()), size(), tag=5)
        assert f"rank {right(rank())}, its peer, raises too" in _message(caught.value)
        assert torch.equal(ms.recv(left(rank()), tag=5), torch.full((2,), float(left(rank()))))
    elif rank() == right(culprit()):
        with pytest.raises(CommunicationError, match=f"sendrecv: rank {culprit()} failed the checks.*src={size()}"):
            ms.sendrecv(x, right(rank()), left(rank()), tag=5)
    else:
        assert torch.equal(ms.sendrecv(x, right(rank()), left(rank()), tag=5), torch.full((2,), float(left(rank()))))
    _assert_in_step()


@pytest.mark.mpi(ranks=(2, 3))
def test_without_validation_a_local_problem_raises_on_its_rank_only() -> None:
    """Validation off: every rank makes the same mistake (so no rank waits); the error says the others were not
    told, and nothing is exchanged for the check."""
    with ms.validation(False):
        with pytest.raises(TypeError) as caught:
            ms.allreduce(None)
        assert "other ranks are not told" in _message(caught.value) or size() == 1
        value = ms.broadcast(torch.ones(3) if rank() == 0 else None, root=0)
    assert torch.equal(value, torch.ones(3))
    _assert_in_step()


def _two_reductions() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs ``a``, ``b`` (this rank's values) and their allreduce-sums, calls #k and #k+1 on the world."""
    a = torch.full((3,), 1.0 + rank(), dtype=torch.float64, requires_grad=True)
    b = torch.full((3,), 10.0 + rank(), dtype=torch.float64, requires_grad=True)
    return a, b, ms.allreduce(a), ms.iallreduce(b).wait()


@pytest.mark.mpi(ranks=(2, 3))
def test_ranks_in_the_backward_of_different_calls_raise_on_every_rank() -> None:
    """The culprit differentiates its two outputs in the other order: without the check the two backward
    allreduces would pair with each other (each rank would get the wrong op's gradient)."""
    a, b, y1, y2 = _two_reductions()
    with pytest.raises(CommunicationError) as caught:
        if rank() == culprit():
            torch.autograd.grad((3 * y2).sum(), b, retain_graph=True)
            torch.autograd.grad((2 * y1).sum(), a)
        else:
            torch.autograd.grad((2 * y1).sum(), a, retain_graph=True)
            torch.autograd.grad((3 * y2).sum(), b)
    text = _message(caught.value)
    assert f"rank {culprit()}: backward of iallreduce(forward call=" in text, text
    assert "backward of allreduce(forward call=" in text and "differentiate the same outputs" in text, text
    _assert_in_step()


@pytest.mark.mpi(ranks=(2, 3))
def test_a_rank_whose_loss_skips_a_collective_raises_on_every_rank() -> None:
    """Autograd prunes the backward of an output the culprit's loss does not use; its next collective meets the
    others' backward of that output, and every rank raises with the advice to keep it with weight zero."""
    a, b, y1, y2 = _two_reductions()
    with pytest.raises(CommunicationError) as caught:
        ((y2 if rank() == culprit() else y1 + y2) * 2).sum().backward()
        ms.allreduce(torch.ones(2))
    text = _message(caught.value)
    assert "ranks called different collectives" in text and "backward of allreduce(forward call=" in text, text
    assert "weight zero" in text, text
    _assert_in_step()


@pytest.mark.mpi(ranks=(1, 2, 3))
def test_backward_through_the_same_collectives_passes_whatever_local_ops_surround_them() -> None:
    """Ranks whose graphs differ in local ops only run the same backward collectives: right gradients, no error."""
    a, b, y1, y2 = _two_reductions()
    if rank() == culprit():
        loss = (y1 * 2).exp().log().sum() + (y2 + 0).sum() * 3
    else:
        loss = (y2 * 3).sum() + (y1 * 2).sum()
    loss.backward()
    assert torch.allclose(a.grad, torch.full((3,), 2.0 * size(), dtype=torch.float64)), a.grad
    assert torch.equal(b.grad, torch.full((3,), 3.0 * size(), dtype=torch.float64)), b.grad
    _assert_in_step()


@pytest.mark.parametrize(("name", "nranks"), [(name, 3 - index % 2) for index, name in enumerate(UNCAUGHT)])
def test_uncaught_bad_input_ends_the_job(name: str, nranks: int) -> None:
    """The same mistake in a script that catches nothing: every rank that raises exits with its traceback, so the
    job ends non-zero within 30 s of the call instead of hanging. Each case at one job size, 2 or 3 ranks in
    turn (every job ends the same way: the ranks that raise exit, mpiexec ends the others)."""
    case = CASES[name]
    code, output, ended = run_mpi_job(SCRIPT, nranks, name, timeout=120 + UNCAUGHT_SECONDS)
    started = [float(line.split()[-1]) for line in output.splitlines() if line.startswith(STARTED)]
    assert started, f"the job never reached the call:\n{output}"
    assert code != 0, f"the job ended with 0:\n{output}"
    assert ended - started[0] < UNCAUGHT_SECONDS, f"the job ran {ended - started[0]:.0f} s after the call:\n{output}"
    assert f"{case.error.__name__}: {case.op}" in output, output  # the culprit's own error
    raisers = 2 if case.pairwise else nranks
    assert output.count("Traceback (most recent call last)") >= raisers, output
