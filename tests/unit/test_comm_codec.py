"""SwitchableCodec, the registry and CommState, in one process (no collectives).

The all-to-all tests replay what TorchRec's `All2All_Pooled_Req` / `All2All_Pooled_Wait` do
with a codec (create_context, padded_size, encode, calc_quantized_size per destination and
per source, decode of the concatenated slices) and check the split sizes add up.

Shape legend: B batch per rank, D summed embedding dim of one rank, W world size.
"""

from __future__ import annotations

import logging

import pytest
import torch
from fbgemm_gpu.quantize_comm import QuantizationContext
from torchrec.distributed.types import CommOp, QuantizedCommCodecs

from loka_train.comm import (
    CodecImpl,
    CommChannel,
    CommConfig,
    CommContext,
    CommPrecision,
    CommState,
    PrecisionSource,
    SwitchableCodec,
    make_qcomm_codecs_registry,
)
from loka_train.comm import state as state_module
from loka_train.kernels.formats import SQNR_CAP_DB, sqnr_db

# Pooled-embedding SQNR floors (dB) through the codec, N(0, 1) data, row_dim=8.
A2A_SQNR_FLOOR_DB = {
    CommPrecision.FP32: SQNR_CAP_DB,  # exact
    CommPrecision.FP16: 65.0,
    CommPrecision.BF16: 48.0,
    CommPrecision.INT8: 40.0,
    CommPrecision.FP8: 28.0,  # e4m3 forward
}


def _state(**overrides: object) -> CommState:
    return CommState(CommConfig(row_dim=8, **overrides), backend="gloo")  # type: ignore[arg-type]


def _simulate_pooled_a2a(
    codec: SwitchableCodec, inputs_WBD: list[torch.Tensor], batch_per_rank: list[int]
) -> list[torch.Tensor]:
    """TorchRec's pooled all-to-all with a codec, all ranks simulated in one process.

    inputs_WBD[r]: rank r's (B_global, D_r) pooled embeddings. Returns each rank's
    (B_r, sum D) output, in rank order of the embedding dims.
    """
    world = len(inputs_WBD)
    dim_sum_per_rank = [x.shape[1] for x in inputs_WBD]
    sent: list[list[torch.Tensor]] = []
    ctxs = []
    for rank, x in enumerate(inputs_WBD):
        ctx = codec.create_context()
        padded_dim, padding = codec.padded_size(x, dim_sum_per_rank, rank, ctx)
        assert (padded_dim, padding) == (x.shape[1], 0)
        payload = codec.encode(x.reshape(-1), ctx)
        input_splits = [codec.calc_quantized_size(padded_dim * b, ctx) for b in batch_per_rank]
        assert sum(input_splits) == payload.numel()
        assert payload.dtype == codec.quantized_dtype
        sent.append(list(payload.split(input_splits)))
        ctxs.append(ctx)
    outputs = []
    for rank in range(world):
        ctx = ctxs[rank]
        output_splits = [
            codec.calc_quantized_size(batch_per_rank[rank] * d, ctx) for d in dim_sum_per_rank
        ]
        received = torch.cat([sent[src][rank] for src in range(world)])
        assert [t.numel() for t in received.split(output_splits)] == output_splits
        decoded = codec.decode(received, ctx)
        by_src = decoded.split([batch_per_rank[rank] * d for d in dim_sum_per_rank])
        outputs.append(
            torch.cat(
                [o.view(batch_per_rank[rank], d) for o, d in zip(by_src, dim_sum_per_rank)],
                dim=1,
            )
        )
    return outputs


@pytest.mark.parametrize("precision", list(CommPrecision))
def test_pooled_a2a_sizes_and_values(precision: CommPrecision) -> None:
    state = _state(a2a_forward=precision)
    codec = make_qcomm_codecs_registry(state)[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward
    batch_per_rank = [4, 4]
    gen = torch.Generator().manual_seed(0)
    # Rank 1 has 100x larger embeddings: per-sender row scales must not mix.
    inputs = [torch.randn(8, 16, generator=gen), 100 * torch.randn(8, 24, generator=gen)]
    outputs = _simulate_pooled_a2a(codec, inputs, batch_per_rank)
    for rank, out in enumerate(outputs):
        rows = slice(4 * rank, 4 * rank + 4)
        for src, ref in enumerate(inputs):
            got = out[:, :16] if src == 0 else out[:, 16:]
            assert sqnr_db(ref[rows], got) >= A2A_SQNR_FLOOR_DB[precision]
    expected_bytes = sum(
        state.wire_format(CommChannel.A2A_FWD, precision).encoded_bytes(x.numel()) for x in inputs
    )
    assert state.end_step()["comm/a2a_fwd/bytes"] == expected_bytes


def test_context_is_fbgemm_quantization_context_and_freezes_precision() -> None:
    state = _state(a2a_backward=CommPrecision.FP8)
    codec = SwitchableCodec(state, CommChannel.A2A_BWD)
    ctx = codec.create_context()
    assert isinstance(ctx, QuantizationContext)
    assert isinstance(ctx, CommContext)
    assert ctx.padded_dim_sum_per_rank is None  # TorchRec reads it: no padding
    grad = torch.randn(64)
    payload = codec.encode(grad, ctx)
    # A switch between encode and decode of the same collective must not change its format.
    state.set_precision(CommChannel.A2A_BWD, CommPrecision.FP32, source=PrecisionSource.EXPLICIT)
    assert codec.calc_quantized_size(64, ctx) == payload.numel() == 8 * 12
    assert sqnr_db(grad, codec.decode(payload, ctx)) > 20  # e5m2: about 26 dB
    # A new collective uses the new precision.
    assert codec.calc_quantized_size(64, codec.create_context()) == 64 * 4


def test_wire_dtype_constant_for_a2a_native_for_reduce_scatter() -> None:
    state = _state(reduce_scatter_forward=CommPrecision.BF16)
    registry = make_qcomm_codecs_registry(state)
    a2a = registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name]
    rs = registry[CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name]
    for precision in CommPrecision:
        state.set_precision(CommChannel.A2A_FWD, precision, source=PrecisionSource.EXPLICIT)
        assert a2a.forward.quantized_dtype == torch.uint8
        assert (
            a2a.forward.encode(torch.randn(16), a2a.forward.create_context()).dtype == torch.uint8
        )
    # Reduce-scatter sums the payload: native dtype, element count kept, decoded by dtype.
    x = torch.randn(4, 8)
    payload = rs.forward.encode(x)
    assert payload.dtype == torch.bfloat16 == rs.forward.quantized_dtype
    assert payload.shape == x.shape and rs.forward.calc_quantized_size(32) == 32
    summed = payload + payload  # what the collective does
    decoded = rs.forward.decode(summed)
    assert decoded.dtype == torch.float32
    assert sqnr_db(2 * x, decoded) > 45


def test_registry_keys_match_torchrec() -> None:
    registry = make_qcomm_codecs_registry(_state())
    assert set(registry) == {
        CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name,
        CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name,
        CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name,
    }
    assert all(isinstance(v, QuantizedCommCodecs) for v in registry.values())
    a2a = registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name]
    assert (a2a.forward.channel, a2a.backward.channel) == (CommChannel.A2A_FWD, CommChannel.A2A_BWD)
    rs = registry[CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name]
    assert (rs.forward.channel, rs.backward.channel) == (CommChannel.RS_FWD, CommChannel.RS_BWD)


@pytest.mark.parametrize("precision", [CommPrecision.FP8, CommPrecision.INT8])
@pytest.mark.parametrize("field", ["reduce_scatter_forward", "reduce_scatter_backward"])
def test_explicit_rowwise_on_reduce_scatter_raises(field: str, precision: CommPrecision) -> None:
    with pytest.raises(
        ValueError, match=f"{precision.name} requested for rs_.*reduce-scatter sums"
    ):
        _state(**{field: precision})


def test_explicit_set_precision_unsupported_raises_and_keeps_old() -> None:
    state = _state(reduce_scatter_forward=CommPrecision.FP16)
    with pytest.raises(ValueError, match="use FP32, FP16 or BF16"):
        state.set_precision(CommChannel.RS_FWD, CommPrecision.FP8, source=PrecisionSource.EXPLICIT)
    assert state.precision(CommChannel.RS_FWD) is CommPrecision.FP16
    assert state.stats.fallbacks == []


def test_bf16_on_old_gloo_raises_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_module, "_gloo_bf16_supported", lambda: (False, "old gloo"))
    with pytest.raises(ValueError, match="old gloo"):
        _state(reduce_scatter_forward=CommPrecision.BF16)
    with pytest.raises(ValueError, match="old gloo"):
        _state(dense_grads=CommPrecision.BF16)
    # Bytes payloads do not depend on gloo's dtype support.
    assert (
        _state(a2a_forward=CommPrecision.BF16).precision(CommChannel.A2A_FWD) is CommPrecision.BF16
    )
    # The replica sync gathers its bf16 payloads as bytes.
    assert (
        _state(replica_sync=CommPrecision.BF16).precision(CommChannel.REPLICA_SYNC) is CommPrecision.BF16
    )
    # NCCL reduces bf16.
    nccl = CommState(
        CommConfig(reduce_scatter_forward=CommPrecision.BF16), backend="nccl", device="cpu"
    )
    assert nccl.precision(CommChannel.RS_FWD) is CommPrecision.BF16


def test_policy_request_unsupported_falls_back_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = _state(adaptive_channels=(CommChannel.RS_FWD, CommChannel.A2A_FWD))
    # The ladder FP32/BF16/FP8 applies to every adaptive channel; FP8 cannot go on the
    # reduce-scatter: counted once at setup, and the policy's ladder there stops at BF16.
    assert [(e.channel, e.requested, e.used) for e in state.stats.fallbacks] == [
        (CommChannel.RS_FWD, CommPrecision.FP8, CommPrecision.BF16)
    ]
    assert state.ladder(CommChannel.RS_FWD) == (CommPrecision.FP32, CommPrecision.BF16)
    assert state.ladder(CommChannel.A2A_FWD) == (
        CommPrecision.FP32,
        CommPrecision.BF16,
        CommPrecision.FP8,
    )
    with caplog.at_level(logging.WARNING, logger="loka_train.comm.state"):
        used = state.set_precision(
            CommChannel.RS_FWD, CommPrecision.INT8, source=PrecisionSource.POLICY
        )
    assert used is CommPrecision.BF16  # nearest supported above INT8
    assert state.precision(CommChannel.RS_FWD) is CommPrecision.BF16
    assert len(state.stats.fallbacks) == 2
    assert "INT8 requested by the policy, BF16 used instead" in caplog.text
    report = state.report()
    assert report["channels"]["rs_fwd"]["precision"] == "BF16"  # type: ignore[index]
    assert [f["requested"] for f in report["fallbacks"]] == ["FP8", "INT8"]  # type: ignore[union-attr]
    assert state.end_step()["comm/fallbacks"] == 2


def test_bytes_per_channel_per_step_and_totals() -> None:
    state = _state(a2a_forward=CommPrecision.FP8, reduce_scatter_forward=CommPrecision.FP16)
    registry = make_qcomm_codecs_registry(state)
    a2a = registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward
    rs = registry[CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name].forward
    state.begin_step(1)
    a2a.encode(torch.randn(64), a2a.create_context())
    a2a.encode(torch.randn(32), a2a.create_context())
    rs.encode(torch.randn(10))
    metrics = state.end_step()
    assert metrics["comm/a2a_fwd/bytes"] == (8 + 4) * 12
    assert metrics["comm/a2a_fwd/calls"] == 2
    assert metrics["comm/rs_fwd/bytes"] == 20
    assert metrics["comm/a2a_bwd/bytes"] == 0
    state.begin_step(2)
    assert state.end_step()["comm/a2a_fwd/bytes"] == 0  # per step
    assert state.stats.total_bytes[CommChannel.A2A_FWD] == 144
    assert state.report()["channels"]["a2a_fwd"]["bytes_by_precision"] == {"FP8": 144}  # type: ignore[index]


def test_sampled_steps_measure_candidates_on_device_buffer() -> None:
    state = _state(adaptive_channels=(CommChannel.A2A_FWD,), sample_every=2)
    codec = SwitchableCodec(state, CommChannel.A2A_FWD)
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    state.begin_step(1)  # not sampled
    codec.encode(x, codec.create_context())
    assert state.sqnr_sums.abs().sum() == 0
    state.begin_step(2)  # sampled
    codec.encode(x, codec.create_context())
    state.end_step()
    sqnr = CommState.sqnr_db_from_sums(state.take_sqnr_sums())[CommChannel.A2A_FWD]
    assert set(sqnr) == {CommPrecision.BF16, CommPrecision.FP8}  # FP32 is lossless: not measured
    assert 50 < sqnr[CommPrecision.BF16] < 60
    assert 28 < sqnr[CommPrecision.FP8] < 38
    assert state.sqnr_sums.abs().sum() == 0  # taken


def test_measure_marks_rowwise_unusable_when_rows_do_not_fit() -> None:
    state = _state(adaptive_channels=(CommChannel.A2A_FWD,))
    state.measure(CommChannel.A2A_FWD, torch.randn(12))  # 12 % row_dim(8) != 0
    sqnr = CommState.sqnr_db_from_sums(state.take_sqnr_sums())[CommChannel.A2A_FWD]
    assert sqnr[CommPrecision.FP8] == float("-inf")
    assert sqnr[CommPrecision.BF16] > 40


def test_fbgemm_codec_needs_cuda() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device.*AUTO or REFERENCE"):
        CommState(CommConfig(codec_impl=CodecImpl.FBGEMM), backend="gloo", device="cpu")


def test_state_dict_roundtrip() -> None:
    # An adaptive channel resumes at the precision its policy had reached (static channels
    # keep their configured precision: tests/unit/test_comm_state.py).
    state = _state(a2a_forward=CommPrecision.FP8, adaptive_channels=(CommChannel.A2A_FWD,))
    saved = state.state_dict()
    other = _state(adaptive_channels=(CommChannel.A2A_FWD,))
    other.load_state_dict(saved)
    assert other.precisions() == state.precisions()
    assert other.precision(CommChannel.A2A_FWD) is CommPrecision.FP8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"a2a_forward": "fp7"}, "comm.a2a_forward='fp7'"),
        ({"ladder": ()}, "ladder is empty"),
        ({"min_precision": "FP32", "max_precision": "FP8"}, "is above"),
        ({"forward_lower_sqnr_db": 10.0, "forward_raise_sqnr_db": 20.0}, "hysteresis band"),
        ({"lower_patience": 0}, "lower_patience=0 must be >= 1"),
        ({"adaptive_channels": ("a2a_fwd",), "sample_every": 0}, "needs measurements"),
        ({"codec_impl": "fbgemm", "row_dim": 6}, "multiple of 4"),
        ({"codec_impl": "fast"}, "comm.codec_impl='fast': choose one of"),
    ],
)
def test_config_validation(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CommConfig(**overrides)  # type: ignore[arg-type]


def test_config_accepts_names_and_values() -> None:
    cfg = CommConfig(a2a_forward="fp8", a2a_backward="BF16", adaptive_channels=("a2a_fwd",))  # type: ignore[arg-type]
    assert cfg.a2a_forward is CommPrecision.FP8
    assert cfg.a2a_backward is CommPrecision.BF16
    assert cfg.adaptive_channels == (CommChannel.A2A_FWD,)


def test_planner_accepts_the_registry() -> None:
    """TorchRec's planner reads quantized_dtype once, for its cost model."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"]
        )
        for i in range(3)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    state = _state(a2a_forward=CommPrecision.FP8, reduce_scatter_forward=CommPrecision.FP16)
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=make_qcomm_codecs_registry(state))
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"))
    plan = planner.plan(ebc, [sharder])
    assert set(plan.plan[""]) == {"t0", "t1", "t2"}  # type: ignore[index]


def test_byte_payload_without_context_raises() -> None:
    codec = SwitchableCodec(_state(), CommChannel.A2A_FWD)
    with pytest.raises(ValueError, match="without a QuantizationContext"):
        codec.encode(torch.randn(8))
    # Reduce-scatter channels keep the element count: no context needed.
    rs = SwitchableCodec(_state(), CommChannel.RS_FWD)
    assert rs.encode(torch.randn(8)).numel() == 8
