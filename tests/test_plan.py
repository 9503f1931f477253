"""The planner's closed forms, parameter table, HLO reader and command line (no compilation)."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import linen as nn

from meshtrain import mesh as mesh_lib, model as model_lib, train_step
from meshtrain.config import ModelConfig
from meshtrain.plan import comm, estimate, hardware, hlo, kernel_model as km, memory
from meshtrain.validate import validate
from tests.utils import ROOT, load_config_file, tiny_config

GB = 10**9


@pytest.mark.parametrize("billions, plain, accum", [(1, 16, 20), (7, 112, 140), (70, 1120, 1400), (405, 6480, 8100)])
def test_playbook_model_size_table(billions, plain, accum):
    n = billions * 10**9
    assert n * memory.playbook_bytes_per_param(False) / GB == plain
    assert n * memory.playbook_bytes_per_param(True) / GB == accum


@pytest.mark.parametrize("stage, gb", [(0, 112.0), (1, 29.31), (2, 15.53), (3, 1.75)])
def test_playbook_zero_figures(stage, gb):
    assert round(memory.playbook_zero_bytes(7e9, stage, 64) / GB, 2) == gb


def test_playbook_gpt2_parameter_formula_and_gib_correction():
    assert memory.playbook_gpt_params(768, 50257, 12) == 123_653_376
    assert memory.playbook_gpt_params(768, 50257, 12, positions=1024) == 124_439_808  # GPT-2 small
    assert round(140e9 / 2**30, 2) == 130.39  # the playbook prints "(=133GiB)"


@pytest.mark.parametrize("tie", [False, True])
def test_param_table_matches_initialised_model(tie):
    config = tiny_config({"fsdp": 2, "tensor": 2}, **{"model.tie_embeddings": tie})
    cfg = ModelConfig.from_config(config)
    mesh = mesh_lib.make_mesh(config, jax.devices()[:4])
    model = model_lib.Transformer(cfg, train_step.Rules.for_mesh(mesh))
    batch = model_lib.dummy_batch(2, 8)
    with jax.set_mesh(mesh):
        boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"], batch["positions"],
                                                  batch["segment_ids"]))["params"]
    leaves = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
    actual = sorted(("/".join(k.key for k in path), tuple(box.value.shape), tuple(box.names)) for path, box in leaves)
    table = [(leaf.path, leaf.shape, leaf.names) for leaf in memory.param_table(cfg)]
    assert sorted(table) == actual
    assert memory.num_params(cfg) == sum(b.value.size for _, b in leaves)


def test_llama3_8b_parameter_count():
    cfg = ModelConfig.from_config(load_config_file("llama3_8b"))
    assert memory.num_params(cfg) == model_lib.num_params(cfg) == 8_030_261_248


def test_state_memory_follows_zero_placement():
    config = tiny_config({"fsdp": 8})
    n = memory.num_params(ModelConfig.from_config(config))
    for stage, (p, g, o) in {0: (1, 1, 1), 1: (1, 8, 8), 2: (1, 8, 8), 3: (8, 8, 8)}.items():
        with config.unlocked():
            config.train.zero_stage = stage
        state = memory.state_memory(memory.Step.from_config(config, validate(config, 8)))
        assert state == {"params": 4 * n // p, "grads": 4 * n // g, "optimizer": 8 * n // o + 12}


@pytest.mark.parametrize("mesh", [{"sequence": 4, "stage": 2}, {"fsdp": 4, "stage": 2}])
def test_zero3_over_either_zero_axis_gathers_the_stage_weights(mesh):
    """ZeRO shards over `sequence` and `fsdp` (`sharding_rules.ZERO_AXES`): a ZeRO-3 pipeline over
    either gathers its stage's weights once per step in the compute dtype (on H100, llama3_8b 4
    layers over sequence 4 x stage 2: planner / compiler 0.791 without the term, 0.912 with it)."""
    def temporaries(zero: int) -> int:
        config = tiny_config(mesh, **{"train.zero_stage": zero, "attention.impl": "ring", "model.n_layers": 8,
                                      "pipeline.schedule": "1f1b", "pipeline.microbatches": 4})
        run = memory.Step.from_config(config, validate(config, 8, inputs=False))
        return memory.activation_memory(run, config.remat.policy)["temporaries"], run
    (zero3, run), (zero1, _) = temporaries(3), temporaries(1)
    compute = run.placement()["compute"]
    whole = sum(memory.local_size(leaf, compute) for leaf in memory.param_table(run.stored_model))
    assert zero3 - zero1 == memory.dtype_bytes(run.model.dtype) * whole > 0


def test_attribute_adds_up_to_the_flat_ring():
    axes = {"data": 2, "fsdp": 4, "tensor": 2}
    for kind, factor in (("all-reduce", 2.0), ("all-gather", 1.0), ("all-to-all", 1.0)):
        split = comm.attribute(kind, 1600.0, axes)
        assert sum(split.values()) == pytest.approx(factor * 15 / 16 * 1600.0, rel=1e-12)
        assert split["tensor"] == pytest.approx(factor * 0.5 * 1600.0)  # innermost axis carries the whole buffer


HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), channel_id=1, replica_groups=[4,2]<=[2,2,2]T(2,1,0), to_apply=%add
  ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[16] {
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ag = f32[16]{0} all-gather(f32[8]{0} %a), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=2], \
device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={0}
  ROOT %cp = f32[16]{0} collective-permute(%ag), source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
}
"""


def test_hlo_reader_groups_trip_counts_and_axes():
    found = hlo.collectives(HLO, 8)
    by_kind = {c.kind: c for c in found}
    assert by_kind["all-reduce"].count == 3 and by_kind["all-reduce"].result_bytes == 32
    assert by_kind["all-reduce"].groups[0] == (0, 4)  # iota [4,2]<=[2,2,2]T(2,1,0)
    assert by_kind["all-gather"].groups[0] == (0, 4)  # ids [[0,4],[1,5],...]: pairs along axis_1
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    assert hlo.group_axes((0, 4), mesh) == {"data": 2}
    sent = hlo.bytes_by_axis(found, mesh)
    assert sent == {"data": pytest.approx(3 * 2 * 0.5 * 32 + 0.5 * 64), "tensor": pytest.approx(64.0)}


KERNELS_HLO = """HloModule k

%fused_dot (p0: f32[3,64,64], p1: bf16[16,64], p2: s32[]) -> f32[16,64] {
  %p0 = f32[3,64,64]{2,1,0} parameter(0)
  %p1 = bf16[16,64]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %ds = f32[1,64,64]{2,1,0} dynamic-slice(%p0, %p2, %z, %z), dynamic_slice_sizes={1,64,64}
  %w = f32[64,64]{1,0} bitcast(%ds)
  %wb = bf16[64,64]{1,0} convert(%w)
  ROOT %d = f32[16,64]{1,0} dot(%p1, %wb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (q0: f32[3,16,64], q1: f32[16,64], q2: s32[]) -> f32[3,16,64] {
  %q0 = f32[3,16,64]{2,1,0} parameter(0)
  %q1 = f32[16,64]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %u = f32[1,16,64]{2,1,0} bitcast(%q1)
  ROOT %dus = f32[3,16,64]{2,1,0} dynamic-update-slice(%q0, %u, %q2, %z, %z)
}

%body (b: (s32[], f32[3,64,64], bf16[16,64], f32[3,16,64])) -> (s32[], f32[3,64,64], bf16[16,64], f32[3,16,64]) {
  %b = (s32[], f32[3,64,64]{2,1,0}, bf16[16,64]{1,0}, f32[3,16,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %ws = f32[3,64,64]{2,1,0} get-tuple-element(%b), index=1
  %x = bf16[16,64]{1,0} get-tuple-element(%b), index=2
  %acc = f32[3,16,64]{2,1,0} get-tuple-element(%b), index=3
  %y = f32[16,64]{1,0} fusion(%ws, %x, %i), kind=kCustom, calls=%fused_dot
  %acc2 = f32[3,16,64]{2,1,0} fusion(%acc, %y, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (s32[], f32[3,64,64]{2,1,0}, bf16[16,64]{1,0}, f32[3,16,64]{2,1,0}) tuple(%i, %ws, %x, %acc2)
}

%cond (c: (s32[], f32[3,64,64], bf16[16,64], f32[3,16,64])) -> pred[] {
  %c = (s32[], f32[3,64,64]{2,1,0}, bf16[16,64]{1,0}, f32[3,16,64]{2,1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (a: f32[3,64,64], x: bf16[16,64], acc: f32[3,16,64]) -> f32[3,16,64] {
  %a = f32[3,64,64]{2,1,0} parameter(0)
  %x = bf16[16,64]{1,0} parameter(1)
  %acc = f32[3,16,64]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[3,64,64]{2,1,0}, bf16[16,64]{1,0}, f32[3,16,64]{2,1,0}) tuple(%zero, %a, %x, %acc)
  %loop = (s32[], f32[3,64,64]{2,1,0}, bf16[16,64]{1,0}, f32[3,16,64]{2,1,0}) while(%init), condition=%cond, \
body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[3,16,64]{2,1,0} get-tuple-element(%loop), index=3
  ROOT %copy = f32[3,16,64]{2,1,0} copy(%out)
}
"""


def test_kernel_reader_prices_each_launch_by_what_it_moves():
    """A scanned layer's GEMM reads one layer of the stacked weights (its dynamic slice), the activation
    and writes its result; the scan's update of the stacked output writes one row in place; loop
    bodies run their trip count; views and tuples launch nothing."""
    found = {k.name: k for k in km.kernels(KERNELS_HLO)}
    assert set(found) == {"y", "acc2", "copy"}
    gemm, update, copy = found["y"], found["acc2"], found["copy"]
    assert (gemm.runs, update.runs, copy.runs) == (3, 3, 1)
    assert gemm.bytes == 64 * 64 * 4 + 16 * 64 * 2 + 4 + 16 * 64 * 4  # one layer's weights, x, the index, y
    assert gemm.flops == 2 * 16 * 64 * 64
    assert update.bytes == 16 * 64 * 4 + 4 + 16 * 64 * 4  # the row read, the index, the row written
    assert update.flops == 0 and copy.bytes == 2 * 3 * 16 * 64 * 4
    times = km.KernelTimes(flop_efficiency=0.5, hbm_efficiency=0.5, launch=1e-6)
    gpu = hardware.get_gpu("h100")
    expected = sum(k.runs * (max(k.flops / (0.5 * gpu.peak_flops), k.bytes / (0.5 * gpu.hbm_bandwidth)) + 1e-6)
                   for k in found.values())
    assert times.seconds(found.values(), gpu) == pytest.approx(expected)


def test_kernel_reader_infers_a_loops_trips_from_its_condition():
    """XLA:GPU leaves some loops (gradient accumulation) without `known_trip_count`: an induction
    variable started from a constant, stepped by one and compared below a constant (here in a fused
    compare) gives the trips; a condition or a step of any other form counts the body once."""
    inferred = KERNELS_HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', "").replace(
        "  ROOT %t = (s32[], f32[3,64,64]{2,1,0}, bf16[16,64]{1,0}, f32[3,16,64]{2,1,0}) tuple(%i, ",
        "  %step = s32[] constant(1)\n  %next = s32[] add(%i, %step)\n"
        "  ROOT %t = (s32[], f32[3,64,64]{2,1,0}, bf16[16,64]{1,0}, f32[3,16,64]{2,1,0}) tuple(%next, ").replace(
        "  ROOT %k = pred[] constant(true)\n",
        "  %n = s32[] get-tuple-element(%c), index=0\n"
        "  ROOT %k = pred[] fusion(%n), kind=kLoop, calls=%fused_compare\n").replace(
        "  %zero = s32[] constant(0)\n", "  %zero0 = s32[] constant(1)\n  %zero = s32[] copy(%zero0)\n").replace(
        "%body (b:", """%fused_compare (r0: s32[]) -> pred[] {
  %r0 = s32[] parameter(0)
  %limit = s32[] constant(4)
  ROOT %lt = pred[] compare(%r0, %limit), direction=LT
}

%body (b:""")
    found = {k.name: k.runs for k in km.kernels(inferred)}
    assert found["y"] == found["acc2"] == 3  # from 1 while below 4
    for opaque in (inferred.replace("direction=LT", "direction=NE"),
                   inferred.replace("%step = s32[] constant(1)", "%step = s32[] constant(2)")):
        assert {k.name: k.runs for k in km.kernels(opaque)}["y"] == 1  # not a count from c below n by ones


def test_kernel_reader_takes_one_branch_of_a_conditional():
    """A conditional runs one branch a call (a pipeline tick's `lax.switch`): by default the branch of
    the most launches (or of the longest time by `price`) counts, with branch weights each its share."""
    text = KERNELS_HLO.replace("  ROOT %copy = f32[3,16,64]{2,1,0} copy(%out)\n", """\
  %k = s32[] parameter(3)
  ROOT %pick = f32[3,16,64]{2,1,0} conditional(%k, %out, %out), branch_computations={%one, %two}
}

%one (o: f32[3,16,64]) -> f32[3,16,64] {
  %o = f32[3,16,64]{2,1,0} parameter(0)
  ROOT %c1 = f32[3,16,64]{2,1,0} copy(%o)
}

%two (t: f32[3,16,64]) -> f32[3,16,64] {
  %t = f32[3,16,64]{2,1,0} parameter(0)
  %c2 = f32[3,16,64]{2,1,0} copy(%t)
  ROOT %c3 = f32[3,16,64]{2,1,0} copy(%c2)""")
    names = lambda ks: sorted(k.name for k in ks if k.name.startswith("c"))  # noqa: E731
    assert names(km.kernels(text)) == ["c2", "c3"]
    assert names(km.kernels(text, price=lambda ks: sum(k.runs for k in ks if k.name == "c1"))) == ["c1"]
    weighted = {k.name: k.runs for k in km.kernels(text, branch_weights=(0.25, 0.75)) if k.name.startswith("c")}
    assert weighted == {"c1": 0.25, "c2": 0.75, "c3": 0.75}
    # in lock-step (a pipeline loop's rows: the branch each of 3 stages takes): each row lasts as long as
    # its slowest stage's branch, here `two` (two copies) wherever a stage takes it
    rows = np.array([[0, 1, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]])
    locked = {k.name: k.runs for k in km.kernels(text, price=lambda ks: sum(k.runs for k in ks), lockstep=(rows, 2))
              if k.name.startswith("c")}
    assert locked == {"c1": 0.5, "c2": 0.5, "c3": 0.5}
    # rows per switch size (a pipeline run as a loop per segment, `slot_program.segment_rows`): the same
    assert {k.name: k.runs for k in km.kernels(text, price=lambda ks: sum(k.runs for k in ks), lockstep={2: rows})
            if k.name.startswith("c")} == locked
    assert {k.name for k in km.kernels(text, lockstep=(rows, 3))} >= {"c2", "c3"}  # other switches: the longest


SKIPPING_HLO = """HloModule s

%run (r: f32[16,64]) -> f32[16,64] {
  %r = f32[16,64]{1,0} parameter(0)
  %r1 = f32[16,64]{1,0} copy(%r)
  %r2 = f32[16,64]{1,0} copy(%r1)
  %r3 = f32[16,64]{1,0} copy(%r2)
  %k = s32[] constant(1)
  ROOT %inner = f32[16,64]{1,0} conditional(%k, %r3, %r3), branch_computations={%one, %two}, \
metadata={op_name="jit(step)/while/body/cond/branch_1_fun/empty_slot/cond/branch_1_fun/cond"}
}

%one (o: f32[16,64]) -> f32[16,64] {
  %o = f32[16,64]{1,0} parameter(0)
  ROOT %n1 = f32[16,64]{1,0} copy(%o)
}

%two (t: f32[16,64]) -> f32[16,64] {
  %t = f32[16,64]{1,0} parameter(0)
  %n2 = f32[16,64]{1,0} copy(%t)
  ROOT %n3 = f32[16,64]{1,0} copy(%n2)
}

%empty (e: f32[16,64]) -> f32[16,64] {
  %e = f32[16,64]{1,0} parameter(0)
  ROOT %e1 = f32[16,64]{1,0} copy(%e)
}

%idle (i: f32[16,64]) -> f32[16,64] {
  %i = f32[16,64]{1,0} parameter(0)
  ROOT %i1 = f32[16,64]{1,0} copy(%i)
}

%stage (s: f32[16,64]) -> f32[16,64] {
  %s = f32[16,64]{1,0} parameter(0)
  %real = pred[] constant(true)
  ROOT %slot = f32[16,64]{1,0} conditional(%real, %s, %s), true_computation=%run, false_computation=%empty, \
metadata={op_name="jit(step)/while/body/cond/branch_1_fun/transpose(jvp())/empty_slot/checkpoint/cond"}
}

ENTRY %main (x: f32[16,64], b: s32[]) -> f32[16,64] {
  %x = f32[16,64]{1,0} parameter(0)
  %b = s32[] parameter(1)
  ROOT %tick = f32[16,64]{1,0} conditional(%b, %x, %x, %x), branch_computations={%idle, %stage, %idle}, \
metadata={op_name="jit(step)/while/body/cond"}
}
"""


def test_kernel_reader_prices_an_uneven_stages_empty_slots_by_its_share():
    """A pipeline tick in lock-step lasts as long as its slowest stage's branch; an uneven stage's branch
    runs its layer (`run`) in the share of its scanned slots that hold one and skips the rest (`empty`,
    the conditional in `slot_program.EMPTY_SLOT_SCOPE`), so a stage of a quarter of the slots prices its
    branch at a quarter of the layer's launches plus three quarters of the empty slot's. A conditional of
    the layer itself (`inner`, scoped inside the skip's branch) keeps its longest branch."""
    launches = lambda ks: sum(k.runs for k in ks)  # noqa: E731

    def runs(**kw) -> dict[str, float]:  # a kernel's runs summed over the branches that walk it
        out = collections.Counter()
        for k in km.kernels(SKIPPING_HLO, price=launches, **kw):
            out[k.name] += k.runs
        return out

    rows = np.array([[0, 1], [0, 1], [1, 1], [0, 0]])  # the branch each of 2 stages takes (of 3), a row a tick
    full, quarter = np.ones(rows.shape), np.tile([1.0, 0.25], (4, 1))
    # without shares (or with every stage's slots full) each of its ticks runs the layer
    assert runs(lockstep={3: rows}) == runs(lockstep={3: rows}, slot_shares={3: full})
    whole = runs(lockstep={3: rows}, slot_shares={3: full})
    assert whole["r1"] == whole["n2"] == whole["n3"] == 0.75 and whole["n1"] == whole["e1"] == 0.0
    # stage 1 at a quarter of the slots: its branch 0.25 x 5 + 0.75 x 1 = 2 launches beats idle's 1 in
    # the first two rows; in the third stage 0's full slots are slowest; the fourth is idle
    shared = runs(lockstep={3: rows}, slot_shares={3: quarter})
    assert shared["r1"] == shared["n3"] == 2 / 4 * 0.25 + 1 / 4 * 1.0
    assert shared["e1"] == 2 / 4 * 0.75
    assert shared["i1"] == 1 / 4 and shared["n1"] == 0.0
    # a stage that runs none of its slots: only the empty one, which ties with idle
    none = runs(lockstep={3: rows[:2]}, slot_shares={3: np.tile([1.0, 0.0], (2, 1))})
    assert none["r1"] == 0.0 and none["e1"] + none["i1"] == 1.0


def test_kernel_reader_prices_a_scatter_into_its_operand_in_place():
    """A fused scatter whose operand is a parameter updates it in place (XLA:GPU's scatter into its
    operand's buffer: the pipeline's embedding-gradient rows): its updates read and the rows they add to
    read and written, not the whole operand."""
    text = """HloModule s

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %z = f32[] add(%x, %y)
}

%fused_scatter (p0: f32[1000,64], p1: s32[16,1], p2: bf16[16,64]) -> f32[1000,64] {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %p1 = s32[16,1]{1,0} parameter(1)
  %p2 = bf16[16,64]{1,0} parameter(2)
  %u = f32[16,64]{1,0} convert(%p2)
  ROOT %s = f32[1000,64]{1,0} scatter(%p0, %p1, %u), update_window_dims={1}, inserted_window_dims={0}, \
scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (a: f32[1000,64], i: s32[16,1], g: bf16[16,64]) -> f32[1000,64] {
  %a = f32[1000,64]{1,0} parameter(0)
  %i = s32[16,1]{1,0} parameter(1)
  %g = bf16[16,64]{1,0} parameter(2)
  ROOT %rows = f32[1000,64]{1,0} fusion(%a, %i, %g), kind=kInput, calls=%fused_scatter
}
"""
    (rows,) = km.kernels(text)
    assert rows.bytes == 16 * 4 + 16 * 64 * 2 + 2 * 16 * 64 * 4  # indices, updates, the rows read and written


@pytest.mark.parametrize("view", [False, True], ids=["operand", "bitcast"])
def test_kernel_reader_prices_a_window_added_in_place(view):
    """A fusion that reads a window of its operand, adds to it and writes it back (a pipeline tick adding
    a chunk's gradients to its sums, `pipeline_tables._add_chunk`) updates the operand in place: the
    window read, the addend read, the window written, not the whole operand; also where the fusion
    reads the operand through a bitcast (XLA gives the sums the layout of the weight gradient's GEMM:
    f32[8,1,16384,6656]{2,1,0,3} seen as [6656,8,1,16384] for 405B in 8 chunks a stage)."""
    sums = "%v" if view else "%p0"
    text = f"""HloModule w

%fused_window (p0: f32[4,2,64], p1: bf16[2,64], p2: s32[]) -> f32[4,2,64] {{
  %p0 = f32[4,2,64]{{2,1,0}} parameter(0)
  %v = f32[4,2,64]{{2,1,0}} bitcast(%p0)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %old = f32[1,2,64]{{2,1,0}} dynamic-slice({sums}, %p2, %zero, %zero), dynamic_slice_sizes={{1,2,64}}
  %p1 = bf16[2,64]{{1,0}} parameter(1)
  %wide = f32[2,64]{{1,0}} convert(%p1)
  %g = f32[1,2,64]{{2,1,0}} bitcast(%wide)
  %new = f32[1,2,64]{{2,1,0}} add(%old, %g)
  ROOT %out = f32[4,2,64]{{2,1,0}} dynamic-update-slice({sums}, %new, %p2, %zero, %zero)
}}

ENTRY %main (a: f32[4,2,64], g: bf16[2,64], c: s32[]) -> f32[4,2,64] {{
  %a = f32[4,2,64]{{2,1,0}} parameter(0)
  %g = bf16[2,64]{{1,0}} parameter(1)
  %c = s32[] parameter(2)
  ROOT %sums = f32[4,2,64]{{2,1,0}} fusion(%a, %g, %c), kind=kLoop, calls=%fused_window
}}
"""
    (added,) = km.kernels(text)
    assert added.bytes == 2 * 64 * 4 + 2 * 64 * 2 + 4 + 2 * 64 * 4  # window read, addend, index, window written


def test_kernel_reader_reads_a_converted_stack_through_its_slice():
    """A fusion that converts a float32 stack of layers and slices one out (a peeled layer of the layer
    loop) reads that layer alone: XLA:GPU's loop emitter computes each output element from the input
    elements it needs."""
    text = """HloModule c

%fused_slice (p0: f32[4,16,64]) -> bf16[1,16,64] {
  %p0 = f32[4,16,64]{2,1,0} parameter(0)
  %c = bf16[4,16,64]{2,1,0} convert(%p0)
  ROOT %s = bf16[1,16,64]{2,1,0} slice(%c), slice={[3:4], [0:16], [0:64]}
}

ENTRY %main (a: f32[4,16,64]) -> bf16[1,16,64] {
  %a = f32[4,16,64]{2,1,0} parameter(0)
  ROOT %layer = bf16[1,16,64]{2,1,0} fusion(%a), kind=kLoop, calls=%fused_slice
}
"""
    (layer,) = km.kernels(text)
    assert layer.bytes == 16 * 64 * 4 + 16 * 64 * 2  # the layer read in float32, written in bf16


@pytest.mark.parametrize("layout, per_row", [("1,0", 64 * 2), ("0,1", 64 * km.SECTOR)], ids=["rows", "columns"])
def test_kernel_reader_reads_a_gather_by_its_rows(layout, per_row):
    """A fusion that gathers rows of a table reads those rows, not the table: a row-major table's rows
    whole, a column-major one's (the embedding gathered by ZeRO along its model dimension) a 32-byte
    sector an element."""
    text = f"""HloModule g

%fused_take (p0: bf16[1000,64], p1: s32[16,1]) -> bf16[16,64] {{
  %p0 = bf16[1000,64]{{{layout}}} parameter(0)
  %p1 = s32[16,1]{{1,0}} parameter(1)
  ROOT %g = bf16[16,64]{{1,0}} gather(%p0, %p1), offset_dims={{1}}, collapsed_slice_dims={{0}}, \
start_index_map={{0}}, index_vector_dim=1, slice_sizes={{1,64}}
}}

ENTRY %main (t: bf16[1000,64], i: s32[16,1]) -> bf16[16,64] {{
  %t = bf16[1000,64]{{{layout}}} parameter(0)
  %i = s32[16,1]{{1,0}} parameter(1)
  ROOT %rows = bf16[16,64]{{1,0}} fusion(%t, %i), kind=kLoop, calls=%fused_take
}}
"""
    (rows,) = km.kernels(text)
    assert rows.bytes == 16 * per_row + 16 * 4 + 16 * 64 * 2  # the rows read, the indices, the rows written


def test_kernel_reader_reads_a_gathered_operand_at_most_once():
    """A gather that takes more rows than its operand holds (each token's row for each of its k experts)
    reads the operand once: the repeats come from cache, not HBM."""
    text = """HloModule r

%fused_take (p0: bf16[16,64], p1: s32[128,1]) -> bf16[128,64] {
  %p0 = bf16[16,64]{1,0} parameter(0)
  %p1 = s32[128,1]{1,0} parameter(1)
  ROOT %g = bf16[128,64]{1,0} gather(%p0, %p1), offset_dims={1}, collapsed_slice_dims={0}, \
start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
}

ENTRY %main (t: bf16[16,64], i: s32[128,1]) -> bf16[128,64] {
  %t = bf16[16,64]{1,0} parameter(0)
  %i = s32[128,1]{1,0} parameter(1)
  ROOT %rows = bf16[128,64]{1,0} fusion(%t, %i), kind=kLoop, calls=%fused_take
}
"""
    (rows,) = km.kernels(text)
    assert rows.bytes == 16 * 64 * 2 + 128 * 4 + 128 * 64 * 2  # the table once, the indices, the rows written


def test_kernel_reader_launches_an_asynchronous_fusion_once():
    """Newer XLA:GPU runs some fusions asynchronously (`fusion-start` / `fusion-done`): one launch, priced
    as the fusion it calls (here a layer's activations written into the saved stack in place)."""
    text = """HloModule a

%fused_dus (p0: bf16[4,8,64], p1: bf16[1,8,64], p2: s32[]) -> bf16[4,8,64] {
  %p0 = bf16[4,8,64]{2,1,0} parameter(0)
  %p1 = bf16[1,8,64]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = bf16[4,8,64]{2,1,0} dynamic-update-slice(%p0, %p1, %p2, %z, %z)
}

ENTRY %main (s: bf16[4,8,64], x: bf16[1,8,64], i: s32[]) -> bf16[4,8,64] {
  %s = bf16[4,8,64]{2,1,0} parameter(0)
  %x = bf16[1,8,64]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %start = ((bf16[4,8,64]{2,1,0}, bf16[1,8,64]{2,1,0}, s32[]), bf16[4,8,64]{2,1,0}, u32[]) fusion-start(%s, %x, %i), \
kind=kLoop, calls=%fused_dus
  ROOT %done = bf16[4,8,64]{2,1,0} fusion-done(%start)
}
"""
    (saved,) = km.kernels(text)
    assert (saved.name, saved.opcode) == ("start", "fusion")
    assert saved.bytes == 8 * 64 * 2 + 4 + 8 * 64 * 2  # the layer read, the index, the layer written


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain.plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_search_llama3_8b_returns_only_fitting_meshes():
    out = _plan("--config", "configs/llama3_8b.py", "--devices", "8", "--gpu", "h100", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    # the search's progress goes to stderr, its last line the number of candidates priced
    priced = re.findall(r"plan: ([\d,]+) candidate layouts priced \(\d+ s\)$", out.stderr, re.M)
    assert priced and int(priced[-1].replace(",", "")) >= len(result["candidates"])
    assert result["num_params"] == 8_030_261_248 and result["candidates"]
    usable = hardware.GPUS["h100"].usable_bytes
    for cand in result["candidates"]:
        mem = cand["memory_per_device_bytes"]
        assert cand["fits"] and mem["total"] <= usable
        assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    # those leaving SEARCH_HEADROOM of HBM spare first, each group by predicted MFU
    spare = [c["memory_per_device_bytes"]["total"] <= (1 - estimate.SEARCH_HEADROOM) * usable
             for c in result["candidates"]]
    assert spare == sorted(spare, reverse=True) and spare[0]
    for group in (True, False):
        mfus = [c["predicted_mfu"] for c, ok in zip(result["candidates"], spare, strict=True) if ok == group]
        assert mfus == sorted(mfus, reverse=True)
    for key in ("mesh", "comm_bytes_per_step", "predicted_step_time_s", "predicted_mfu"):
        assert key in result


def test_search_tries_each_pipeline_schedule_on_a_pipelined_mesh():
    """On stage 4 x fsdp 2 (llama3_8b, 8 devices) the search's candidates include every schedule of
    PIPELINE_CHOICES at each ZeRO stage and remat; priced by the lock-step model, the overlapped 1F1B
    idles less than the plain loop, interleaved 1F1B (v=2) less than both, for more activation memory,
    and in 4 chunks less again."""
    config = load_config_file("llama3_8b")
    gpu = hardware.get_gpu("h100")
    found = {}
    for c, sizes in estimate.candidate_configs(config, 8):
        if sizes["stage"] == 4 and sizes["fsdp"] == 2 and c.train.zero_stage == 1 and c.remat.policy == "full":
            found[(c.pipeline.schedule, c.pipeline.repeats, c.pipeline.overlap_transfers)] = estimate.estimate(
                c, sizes, gpu)
    assert set(found) == set(estimate.PIPELINE_CHOICES) == {
        ("1f1b", 1, False), ("1f1b", 1, True), ("interleaved_1f1b", 2, True), ("interleaved_1f1b", 4, True)}
    plain, overlapped, interleaved = (found[k] for k in estimate.PIPELINE_CHOICES[:3])
    assert interleaved.bubble_seconds < overlapped.bubble_seconds < plain.bubble_seconds
    assert interleaved.memory["activations"] > plain.memory["activations"]
    assert "interleaved_1f1b v=2, transfers overlapped" in interleaved.pipeline
    assert found[("interleaved_1f1b", 4, True)].bubble_seconds < interleaved.bubble_seconds


def test_search_candidates_pass_every_layout_rule_and_a_bad_field_leaves_none():
    """The search checks a config's fields once a mesh and the layout rules per combination: every
    candidate it yields passes the whole of `validate` (with the same mesh shape), it tries every mesh
    of 8 devices the batch divides, and a field no combination sets, when invalid, leaves no candidate."""
    config = load_config_file("tiny")  # 4 layers: the layout rules turn down 8 stages and v=2 on 4
    candidates = list(estimate.candidate_configs(config, 8))
    for c, sizes in candidates:
        assert validate(c, 8, inputs=False) == sizes
    meshes = {tuple(sizes.items()) for _, sizes in candidates}
    assert len(meshes) > 20 and {"stage", "tensor", "fsdp", "data", "sequence"} <= {
        a for m in meshes for a, n in m if n > 1}
    with config.unlocked():
        config.train.learning_rate = -1.0
    assert not list(estimate.candidate_configs(config, 8))


@pytest.mark.parametrize("args, message", [
    (("--gpu", "h900", "--devices", "8"), "unknown GPU"),
    (("--devices", "8", "--config.mesh.fsdp=4", "--config.mesh.data=1"), "multiply to 4 but there are 8 devices"),
])
def test_bad_input_is_one_clear_message(args, message):
    out = _plan("--config", "configs/tiny.py", *args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_nothing_fits_says_what_would_have_to_change():
    out = _plan("--config", "configs/llama3_70b.py", "--devices", "2", "--gpu", "a100")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "no mesh of 2 x A100" in out.stderr and "It would take" in out.stderr and "devices" in out.stderr


def test_in_node_axes_and_time_model():
    sizes = {"data": 4, "stage": 1, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 8}
    assert estimate.in_node_axes(sizes, 8) == {"tensor", "sequence", "expert", "stage"}
    config = load_config_file("llama3_8b")
    est = estimate.estimate(config, validate(config, 64), hardware.get_gpu("h100"))
    assert est.step_seconds >= est.compute_seconds > 0 and 0 < est.mfu <= estimate.EFFICIENCY


SCHEDULED = """HloModule step, is_scheduled=true

%rs_body (a: f32[8]) -> f32[2] {
  %a = f32[8]{0} parameter(0)
  ROOT %rs = f32[2]{0} reduce-scatter(%a), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[8], w: f32[8,8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %ag-start = (f32[2]{0}, f32[8]{0}) all-gather-start(%p), replica_groups={{0,1,2,3}}, dimensions={0}
  %f1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused
  %gemm = (f32[8,8]{1,0}, s8[16]{0}) custom-call(%w, %w), custom_call_target="__cublas$gemm"
  %ag-done = f32[8]{0} all-gather-done(%ag-start)
  %rs-start = ((f32[8]{0}), f32[2]{0}) async-start(%f1), calls=%rs_body
  %rs-done = f32[2]{0} async-done(%rs-start)
  %ar-start = f32[8]{0} all-reduce-start(%ag-done), replica_groups={{0,1,2,3}}, to_apply=%add
  %f2 = f32[8]{0} fusion(%ag-done), kind=kLoop, calls=%fused
  ROOT %ar-done = f32[8]{0} all-reduce-done(%ar-start)
}
"""


def test_async_overlap_counts_compute_between_start_and_done():
    pairs = {p.kind: p for p in hlo.async_overlap(SCHEDULED)}
    assert set(pairs) == {"all-gather", "reduce-scatter", "all-reduce"}
    assert pairs["all-gather"].compute_between == 2 and pairs["all-gather"].overlapped
    assert pairs["reduce-scatter"].compute_between == 0 and not pairs["reduce-scatter"].overlapped
    assert pairs["all-reduce"].compute_between == 1


SCHEDULED_SWITCH = """HloModule tick, is_scheduled=true

%idle (c: f32[8]) -> f32[8] {
  ROOT %c = f32[8]{0} parameter(0)
}

%forward (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  ROOT %f = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused
}

ENTRY %main (i: s32[], x: f32[8], y: f32[8]) -> f32[8] {
  %i = s32[] parameter(0)
  %x = f32[8]{0} parameter(1)
  %y = f32[8]{0} parameter(2)
  %cp-start = (f32[8]{0}, f32[8]{0}) collective-permute-start(%x), source_target_pairs={{0,1}}
  %switch = f32[8]{0} conditional(%i, %y, %y), branch_computations={%idle, %forward}
  %cp-done = f32[8]{0} collective-permute-done(%cp-start)
  %cp-start.1 = (f32[8]{0}, f32[8]{0}) collective-permute-start(%switch), source_target_pairs={{1,0}}
  %nothing = f32[8]{0} conditional(%i, %y, %y), branch_computations={%idle, %idle}
  ROOT %cp-done.1 = f32[8]{0} collective-permute-done(%cp-start.1)
}
"""


def test_async_overlap_counts_a_switch_that_computes():
    """A pipeline tick's `lax.switch` between a permute's start and done is compute when one of its
    branches holds some; a switch over branches that compute nothing is not."""
    first, second = hlo.async_overlap(SCHEDULED_SWITCH)
    assert first.kind == second.kind == "collective-permute"
    assert first.overlapped and not second.overlapped
