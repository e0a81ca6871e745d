"""End-to-end training benchmark against BF16, FP8 everywhere, torchao and LoKA (issue 9).

Every run is a real ``Trainer`` job (TorchRec ``DistributedModelParallel``, fused row-wise
Adagrad tables, ``TrainPipelineSparseDist``, bf16 autocast of the dense towers), world size 1,
all in this one process, one after another, with the same data and seeds (``--repeats N``:
N interleaved rounds, round i with ``trainer.seed=i``, aggregated), or each in a fresh process
of its own (``--isolate``: a run leaves state that slows the later runs of a process). Jobs are composed
from ``conf/`` with hydra overrides, exactly as ``launch/train.py`` composes them, so the LoKA
variants measure the real ``conf/loka/{safe,aggressive}.yaml`` presets.

Model configs (``--configs``):
  * ``dlrm``: small DLRM, the sizes of ``conf/model/dlrm.yaml``;
  * ``dcn``: DLRM-DCN with MLPerf DLRM-DCNv2 dense sizes (bottom 512-256-128, top
    1024-1024-512-256-1, 3 low-rank (512) cross layers, 26 tables x 128);
  * ``wukong``: dense-heavy Wukong-style model (2 layers, FM MLP hidden 4096, top
    4096-2048-1024-1, 26 tables x 128).

Variants (``--variants``; a ``+compile`` suffix compiles the dense submodules of the others, a
``+graphs`` suffix replays them as CUDA graphs, ``trainer.cuda_graphs``, GPU only; both,
``+compile+graphs``, replay the compiled code; the torchao variants, always compiled, take
``+graphs``):
  * ``bf16``: LoKA off (the reference of every ratio); ``bf16+compile``;
  * ``fp8_everywhere``: every site FP8 tensor-wise from step 0 on ``torch._scaled_mm``, probe,
    dispatch, guard and comm off. By design the final logit layer stays high precision, and
    batched (``bmm``) sites have no FP8 backend but ``emulated``: they stay bf16 on GPU; the
    results list every GEMM that is not FP8 and why;
  * ``loka_high`` (not in the default list): the converted sites in high precision with the
    Probe, Dispatch, guard and comm off, to separate the conversion from the Probe;
  * ``torchao_tensorwise`` / ``torchao_rowwise``: torchao ``convert_to_float8_training``
    (Linear layers whose dims are multiples of 16, the logit layer excluded), compiled;
    recorded as "not run" where ``import torchao`` fails;
  * ``loka_safe`` / ``loka_aggressive``: the presets. Their first re-plan comes after hundreds
    of steps (probe interval 500 / 200), far beyond a short benchmark, so each LoKA variant
    first runs a *decision run* (``--decide-steps`` steps, the preset with every site sampled
    every step and an interval of ``--decide-interval``; with ``--ne-from``, from the shared
    checkpoint), then the timed run starts from fresh weights (or that checkpoint) with the
    decided Probe / Dispatch state (the checkpoint-resume path) and the
    preset's own sparse sampling schedule, whose sampled steps fall in the timed window. With
    ``--share-decisions``, variants that differ only in how plans run (``+static``,
    ``+dynamic``) take the first one's decided state: the same plans (those Dispatch picked
    with the first one's timings), one decision run; ``--decide-once`` also shares it across
    seeds; ``--decisions DIR`` keeps each decided state in a file and takes it from there in
    later processes and calls, so that speed runs in processes of their own, the ledger and
    the paired NE measure the same plans.
    ``loka_*+compile`` runs: dynamo compiles the site code once per distinct site shape and
    dtype (all sites share one code object, hence ``compile_dense`` raises the recompile
    limit) and for eval's no-grad mode, and breaks the graph around the Probe on sampled
    steps (CPU dry run, ``TORCH_LOGS=recompiles``: 39 recompiles in the whole DCN run, none
    per step). On an H100 compiled alone was host-bound (LoKA safe 36.9 ms against 13.7 eager
    bf16 on Wukong, bench/results/e2e_compile_graphs_h100_2026-11-23e); with ``+graphs`` the
    captures run on steps the Probe does not sample, so the compiled capture has no graph
    break per site.

Measurement: ``--warmup`` steps, then ``--steps`` timed steps (on CUDA the time between CUDA
events recorded at consecutive step ends, with no host sync, so the host runs ahead as in a real
run; ``--timing sync`` for wall time with ``torch.cuda.synchronize()`` at every step end):
median, p10, p90; then ``--profile-steps`` more steps (every variant trains the same number
of steps), profiled with torch.profiler for ``--profile-variants``: GPU kernel time split into
GEMM / FP8 quantization / embedding / copies / other (elementwise, norms, reductions), and the
GPU busy fraction (merged kernel time per step / median step time), and the host side (aten
calls per step, top operators by self CPU time). Eval NE on ``--eval-batches`` held-out
batches at the end. The train batches are generated before the runs (``--cache-batches``,
by default one per step, so none repeats) so the CPU generator does not bound the step time.

Writes ``e2e.json`` (everything) and ``e2e.md`` (tables, command, GPU, versions, and each
target as met / missed / unresolved (the speed within the rotated rounds' paired interval, or
the speed met and the NE delta within its noise) / not evaluated, with its figures: those of
issue 26 against bf16 with the same settings (speed per config and preset, NE within 0.02%,
peak reserved memory within 1.05x under ``--isolate``, the quantization of Wukong's four
largest sites within a quarter of their FP8 savings under ``--ledger``, torchao), then those of
issue 9 against eager bf16) under ``--out``. A variant that fails is
recorded with its error and the benchmark goes on; the exit status is then 1.

Usage (GPU: the packages of ../shared/device/make-bundle, carried as .device):
    source .device/activate.sh && python3 -m bench.e2e --configs dcn --out $OUT/e2e  # H100: a few min per config
    python -m bench.e2e --out /tmp/e2e --dry-run                         # CPU, tiny, < 1 min
    python -m bench.e2e --out /tmp/e2e --configs dcn --variants bf16,loka_safe --steps 100
    # NE at the 0.1% resolution (H100: ~5 min): per seed a shared bf16 checkpoint at step 300,
    # then every variant 200 steps from it with both rates decaying (seed-paired deltas)
    python -m bench.e2e --out $OUT/ne --configs wukong --batches 32768 --ne-from 300 --ne-steps 200 \
        --ne-decay 1.0 --repeats 3 --no-profile --variants bf16,loka_safe+compile+graphs
    # host-bound ratios: every (variant, round) in its own process, rotated
    python -m bench.e2e --out $OUT/b8192 --configs dlrm --batches 8192 --repeats 3 --isolate \
        --variants bf16+compile+graphs,loka_safe+compile+graphs

Run it from the repository root (``bench`` is a package there). Its parts: ``cli`` (the
arguments and ``main``), ``variants`` (the model configs, the variants and each one's job),
``protocol`` (the runs, warm runs, rotated rounds, seed pairing and the NE protocol),
``isolate`` (``--isolate``: each run in a child process, their records merged),
``measure`` (the step clock and the profile summary), ``verdicts`` (ratios against bf16 and
the targets' verdicts) and ``report`` (e2e.json and e2e.md).
"""
