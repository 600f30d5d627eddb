"""The delta transport (weight_sync/delta.py, delta_codec.py): every receiver ends with the
sender's buffer bit for bit, whatever changed (nothing, ~10%, everything, signed zeros and
NaN payloads), in float32 and bfloat16; a receiver without a base, or with a stale one,
makes that sync a full one for the whole group, and deltas resume after it; a sender and a
receiver that replace their own (a new group) keep their base."""

from __future__ import annotations

import threading

import pytest
import torch

from torchtitan_rl.weight_sync import delta_codec
from torchtitan_rl.weight_sync.delta import DELTA, FULL, DeltaReceiver, DeltaSender
from torchtitan_rl.weight_sync.packing import make_layout

INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.dtype])


def _changed(base: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`base` with about `fraction` of its elements moved (in their dtype)."""
    g = torch.Generator().manual_seed(seed)
    where = torch.rand(base.shape, generator=g) < fraction
    new = base.clone()
    new[where] = (base.float()[where] * 1.5 + 1.0).to(base.dtype)
    return new


def test_the_codec_marks_element_i_as_bit_i_mod_8_and_keeps_the_values_in_order():
    base = torch.tensor([1.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 0.0, 9.0])
    new = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    bits, vals, counts = delta_codec.encode(new, base)
    assert bits.tolist() == [0b1000_0010, 0] and vals.tolist() == [2.0, 8.0]
    assert counts.tolist() == [2]
    assert torch.equal(delta_codec.decode(base, bits, vals, counts), new)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 1.0])
def test_decoding_the_delta_onto_the_base_gives_the_new_buffer_bit_for_bit(
    monkeypatch, dtype, fraction
):
    monkeypatch.setattr(delta_codec, "CHUNK", 64)  # many chunks, a short last one
    base = torch.randn(64 * 5 + 13, generator=torch.Generator().manual_seed(0)).to(dtype)
    new = _changed(base, fraction, seed=1)
    new[:4] = torch.tensor([0.0, -0.0, float("nan"), 1.0])
    base[:4] = torch.tensor([-0.0, -0.0, 1.0, 1.0])  # -0.0 vs 0.0 is a change of bits
    nan2 = _bits(new.clone())
    nan2[2] = nan2[2] ^ 1  # another NaN payload: equal as NaN, different in bits
    base2 = nan2.view(dtype)
    for b in (base, base2):
        bits, vals, counts = delta_codec.encode(new, b)
        want = int((_bits(new) != _bits(b)).sum())
        assert vals.numel() == want == int(counts.sum()) and counts.numel() == 6
        before = _bits(b).clone()
        out = delta_codec.decode(b, bits, vals, counts)
        assert torch.equal(_bits(out), _bits(new))
        assert torch.equal(_bits(b), before), "the base is left as it was"


def _form(sender, receivers):
    threads = [threading.Thread(target=r.form) for r in receivers]
    for t in threads:
        t.start()
    sender.form()
    for t in threads:
        t.join(timeout=60)


def _sync(sender, receivers, new_P, version):
    """Send `new_P` as `version`; every receiver's result, and what the send did."""
    sender.buffer().copy_(new_P)
    got = [None] * len(receivers)

    def receive(i):
        got[i] = receivers[i].receive_blocking()

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(len(receivers))]
    for t in threads:
        t.start()
    sender.send(version)
    for t in threads:
        t.join(timeout=60)
    for packed in got:
        assert packed.version == version
        assert torch.equal(_bits(packed.flat_P), _bits(new_P)), "bit for bit"
    return sender.last


def _group(layout, numel, dtype, receivers, previous=None):
    """A sender and its receivers; `receivers[i]`: the receiver that member i + 1 replaces
    (None: a fresh process)."""
    sender = DeltaSender(layout, numel, dtype, len(receivers), previous=previous)
    members = [DeltaReceiver(sender.group, i + 1, previous=r) for i, r in enumerate(receivers)]
    _form(sender, members)
    return sender, members


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deltas_are_bit_identical_and_a_missing_or_stale_base_gets_a_full_send(dtype):
    numel = 4099
    layout, _ = make_layout({"w": torch.zeros(numel)})
    g = torch.Generator().manual_seed(0)
    versions = [torch.randn(numel, generator=g).to(dtype)]
    for fraction in (0.1, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1):
        versions.append(_changed(versions[-1], fraction, seed=len(versions)))
    sender, (a, b) = _group(layout, numel, dtype, [None, None])
    modes = [_sync(sender, [a, b], versions[v], v)["mode"] for v in range(4)]
    # no base; ~10% changed; nothing changed; everything changed (a delta would be larger)
    assert modes == [FULL, DELTA, DELTA, FULL]
    assert sender.last["bytes"] == numel * versions[0].element_size()
    # b dies; a new group over a alone: a keeps its base, so the next send is a delta
    sender, (a2,) = _group(layout, numel, dtype, [a], previous=sender)
    last = _sync(sender, [a2], versions[4], 4)
    changed = int((_bits(versions[4]) != _bits(versions[3])).sum())
    assert last == {"mode": DELTA, "changed": changed, "bytes": last["bytes"]}
    assert last["bytes"] == delta_codec.delta_bytes(numel, changed, versions[0].element_size()) + 8
    # b comes back with its stale base (version 3), then a fresh replica c: full, then deltas
    sender, (a3, b2) = _group(layout, numel, dtype, [a2, b], previous=sender)
    assert [_sync(sender, [a3, b2], versions[v], v)["mode"] for v in (5, 6)] == [FULL, DELTA]
    sender, (a4, c) = _group(layout, numel, dtype, [a3, None], previous=sender)
    assert [_sync(sender, [a4, c], versions[v], v)["mode"] for v in (7, 6)] == [FULL, DELTA]
    sender.close()
    for r in (a4, c):
        r.close()
