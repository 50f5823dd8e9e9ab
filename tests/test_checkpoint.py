"""Checkpoints restore bit for bit onto any mesh, rule set, device count and process."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscale import (
    TINY,
    Checkpoints,
    Config,
    Trainer,
    TrainOptions,
    Transformer,
    adamw,
    cli,
    create,
    events,
    pipeline,
)
from nnxscale.checkpoint import (
    PARTIAL,
    CheckpointMismatchError,
    CorruptCheckpointError,
    NoCheckpointError,
    check_matches,
    chunks_read,
    file_role,
    record_from,
    sealed,
)
from nnxscale.checkpoint.integrity import checksums, seal
from nnxscale.model.losses import next_token_loss
from nnxscale.parallelism.schedules import interleaved
from nnxscale.placement.catalogue import DP, FSDP, TP
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import Layout, resolve
from nnxscale.placement.mesh import make_mesh
from nnxscale.placement.rules import strategy_mesh
from nnxscale.runtime.devices import FAST_COMPILE
from nnxscale.train import TrainState
from nnxscale.train.data import Batches, book_batches

BATCHES = book_batches(batch_size=16)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """8 FSDP steps on 8 devices, saved (asynchronously) after steps 2, 4, 6 and 8, keeping 2."""
    directory = tmp_path_factory.mktemp("run")
    trainer = Trainer.create(create(TINY), adamw(), FSDP, strategy_mesh(FSDP))
    checkpoints = Checkpoints(directory, keep=2)
    losses, sums = [], {}
    for _ in range(4):
        losses += trainer.train(BATCHES, 2)
        sums[trainer.step_count()] = checksums(trainer.state)
        checkpoints.save(trainer, BATCHES)  # training goes on while Orbax writes
    checkpoints.wait()
    return {"dir": directory, "trainer": trainer, "losses": losses, "sums": sums,
            "checkpoints": checkpoints}  # fmt: skip


@pytest.mark.slow
def test_keeps_the_last_k(run) -> None:
    assert run["checkpoints"].steps() == [6, 8]
    assert sorted(p.name for p in run["dir"].iterdir()) == [
        ".nnxscale-writer.lock",  # the writer's lock (taken while it is open)
        "6",
        "8",
        "nnxscale-run.json",  # the run whose checkpoints these are
    ]


def test_each_save_records_when_it_started_returned_and_was_written(run) -> None:
    times = run["checkpoints"].times
    assert sorted(times) == [2, 4, 6, 8]
    for step, t in times.items():
        assert t.started <= t.returned <= t.written, step
    # one save in flight: each is written before the next one returns
    ordered = [times[s] for s in sorted(times)]
    assert all(a.written <= b.returned for a, b in itertools.pairwise(ordered))


def test_record_describes_the_run(run) -> None:
    record = run["checkpoints"].record(6)
    assert record.step == 6
    assert Config(**record.config) == TINY
    assert record.rules["name"] == "FSDP" and record.mesh == {"data": 8, "model": 1}
    assert record.devices == 8 and record.processes == 1 and record.ema_decay == 0.9
    assert record.data == {**BATCHES.describe(), "next_batch": 6}
    assert set(record.versions) >= {"jax", "flax", "orbax-checkpoint"}
    shown = record._repr_markdown_()
    assert "| model | Config() (the defaults) |" in shown
    assert "| rule set | FSDP (vocab: data, embed: data, heads: replicated," in shown
    assert "next_batch 6" in shown


def test_restores_bit_for_bit_on_the_same_mesh(run) -> None:
    for step in (6, 8):
        restored = run["checkpoints"].restore(
            Transformer.from_config, adamw(), FSDP, strategy_mesh(FSDP), step=step
        )
        assert checksums(restored.state) == run["sums"][step]
        assert restored.step_count() == step


def test_restores_onto_tp_on_a_2d_mesh(run) -> None:
    mesh = strategy_mesh(TP)
    restored = run["checkpoints"].restore(Transformer.from_config, adamw(), TP, mesh)
    assert checksums(restored.state) == run["sums"][8]
    embed = restored.state["model"]["embed"][...]
    assert embed.sharding.mesh.shape == mesh.shape
    assert tuple(embed.sharding.spec) == ("model", None)
    assert restored.state["rngs"]["dropout"]["key"][...].dtype == jax.random.key(0).dtype


def test_restores_onto_dp_on_one_device(run) -> None:
    restored = run["checkpoints"].restore(
        Transformer.from_config, adamw(), DP, strategy_mesh(DP, 1)
    )
    assert checksums(restored.state) == run["sums"][8]
    assert len(restored.state["model"]["embed"][...].devices()) == 1


def test_restores_in_another_process_with_half_the_devices(run, tmp_path) -> None:
    report = tmp_path / "report.json"
    out = cli.run("restore", str(run["dir"]), "--rules", "FSDP", "--report", str(report),
                  devices=4)  # fmt: skip
    got = json.loads(report.read_text())
    assert got["devices"] == 4 and got["step"] == 8
    assert got["checksums"] == run["sums"][8]
    (restored,) = events.read(out, events.Restored)
    assert restored.mesh == {"data": 4, "model": 1} and restored.saved["devices"] == 8


@pytest.mark.slow
def test_resumed_run_equals_the_uninterrupted_run(run) -> None:
    resumed = run["checkpoints"].restore(
        Transformer.from_config, adamw(), FSDP, strategy_mesh(FSDP), step=6, data=BATCHES
    )
    assert resumed.train(BATCHES, 2) == run["losses"][6:8]  # exactly
    assert checksums(resumed.state) == run["sums"][8]


@pytest.mark.slow
def test_restore_into_reuses_a_trainer(run) -> None:
    trainer = run["checkpoints"].restore(
        Transformer.from_config, adamw(), FSDP, strategy_mesh(FSDP), step=8
    )
    trainer.train(BATCHES, 1)
    compiled = trainer.compiled
    run["checkpoints"].restore_into(trainer, step=6, data=BATCHES)
    assert trainer.step_count() == 6
    assert trainer.train(BATCHES, 2) == run["losses"][6:8]
    assert trainer.compiled is compiled


def test_chunks_are_the_shards_that_were_held(run) -> None:
    chunks = run["checkpoints"].chunks()
    layout = run["trainer"].layout
    assert chunks == {p.path: p.shard_shape for p in layout.placements if p.shape} | {
        p.path: (2,) if "key" in p.dtype else () for p in layout.placements if not p.shape
    }


def test_files_are_described(run) -> None:
    assert all(role != "other" for _, _, role in run["checkpoints"].files())


@pytest.mark.slow
@pytest.mark.parametrize("rules", [DP, FSDP, TP], ids=lambda r: r.name)
def test_every_device_writes_an_equal_share_of_every_array(run, rules, tmp_path) -> None:
    """Distinct shards are written whole; replicated shards are split between their replicas.

    That is Orbax's default except when JAX_PLATFORMS names a GPU, where one replica writes.
    """
    trainer = run["checkpoints"].restore(
        Transformer.from_config, adamw(), rules, strategy_mesh(rules)
    )
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(trainer)
        checkpoints.wait()
        values, chunks = checkpoints.stored_values(), checkpoints.chunks()
    counts = {
        p.path: math.prod(p.shape) // math.prod(chunks[p.path])
        for p in trainer.layout.placements
        if p.shape
    }
    assert set(counts.values()) == {8}
    stored = [k for k in values if not k.endswith("/.zarray")]
    scalars = len(trainer.layout.placements) - len(counts)
    assert len(stored) == sum(counts.values()) + scalars
    assert len(values) - len(stored) == len(trainer.layout.placements)  # a header per array
    assert sum(values[k] for k in stored) < trainer.layout.total_bytes()  # zstd


def test_other_optimizer_names_the_mismatching_arrays(run) -> None:
    with pytest.raises(CheckpointMismatchError) as error:
        run["checkpoints"].restore(
            Transformer.from_config, optax.sgd(0.1), FSDP, strategy_mesh(FSDP)
        )
    message = str(error.value)
    assert "43 arrays checkpoint 8 has and the target lacks" in message
    assert "optimizer/opt_state/0/count" in message
    assert "and 37 more, all under optimizer/opt_state/0." in message


def fsdp_target(cfg: Config) -> tuple[nnx.State, Layout]:
    """An abstract train state of `cfg` and its FSDP layout: what a restore reads into."""
    _, values = nnx.split(abstract(lambda: TrainState(create(cfg), adamw())))
    return values, resolve(values, FSDP, strategy_mesh(FSDP))


def test_other_model_names_the_mismatching_arrays(run) -> None:
    with pytest.raises(CheckpointMismatchError, match="does not match") as error:
        run["checkpoints"].restore_state(*fsdp_target(TINY.replace(layers=3)))
    # a block has 8 arrays, each in the model, the EMA and AdamW's two moments
    assert "36 arrays the target has and checkpoint 8 lacks: ema/blocks/2/attention/key" in str(
        error.value
    )
    with pytest.raises(CheckpointMismatchError) as error:
        run["checkpoints"].restore_state(*fsdp_target(TINY.replace(vocab=64)))
    message = str(error.value)  # the embedding and the head, 4 times each
    assert (
        "8 arrays of another shape or dtype: ema/embed (saved (128, 64) float32, wanted "
        "(64, 64) float32)" in message
    )


def test_other_data_is_refused(run) -> None:
    other = Batches(BATCHES.tokens, batch_size=16, length=32, seed=1)
    with pytest.raises(CheckpointMismatchError, match="seed saved 0"):
        run["checkpoints"].restore(
            Transformer.from_config, adamw(), FSDP, strategy_mesh(FSDP), data=other
        )


def test_missing_or_empty_directory(tmp_path) -> None:
    with pytest.raises(NoCheckpointError, match="no checkpoint directory"):
        Checkpoints(tmp_path / "absent", create=False)
    empty = Checkpoints(tmp_path / "empty")
    with pytest.raises(NoCheckpointError, match="it is empty"):
        empty.restore(Transformer.from_config, adamw(), FSDP, strategy_mesh(FSDP))
    with pytest.raises(RuntimeError, match="no checkpoint directory"):
        cli.run("restore", str(tmp_path / "absent"), devices=2)


def test_missing_step(run) -> None:
    with pytest.raises(NoCheckpointError, match=r"holds no checkpoint of step 2.*\[6, 8\]"):
        run["checkpoints"].record(2)


def test_check_matches_lists_every_kind_of_difference() -> None:
    saved = {"a": ((2,), "float32"), "b": ((3,), "float32"), "c": ((4,), "int32")}
    wanted = {"a": ((2,), "float32"), "c": ((4,), "float32"), "d": ((1,), "float32")}
    with pytest.raises(CheckpointMismatchError) as error:
        check_matches(saved, wanted, "checkpoint 1")
    message = str(error.value)
    assert "1 arrays the target has and checkpoint 1 lacks: d" in message
    assert "1 arrays checkpoint 1 has and the target lacks: b" in message
    assert "c (saved (4,) int32, wanted (4,) float32)" in message
    check_matches(saved, dict(saved), "checkpoint 1")


def test_file_roles() -> None:
    assert file_role("state/ocdbt.process_3/d/abc").startswith("array data")
    assert file_role("meta/metadata") == "the run's record (JSON)"
    assert file_role("something/else") == "other"


@pytest.mark.slow
def test_a_save_killed_mid_write_loses_only_the_steps_since_the_last(tmp_path: Path) -> None:
    directory = tmp_path / "crash"
    crash = cli.crash_during_save(directory, steps=6, save_every=3, devices=8, batch_size=16)
    assert crash.returncode == -9
    assert sorted(crash.checksums) == [3, 6] and sorted(crash.losses) == list(range(6))
    # The killed save left a partial directory, which restores ignore.
    survivors = Checkpoints(directory, create=False)
    assert survivors.partial() == [f"6{PARTIAL}"]
    assert survivors.steps() == [3]
    resumed = survivors.restore(
        Transformer.from_config, adamw(), FSDP, strategy_mesh(FSDP), data=BATCHES
    )
    assert checksums(resumed.state) == crash.checksums[3]
    # Resuming redoes steps 3 to 5, exactly as the killed run did them, and reaches its state.
    assert resumed.train(BATCHES, 3) == [crash.losses[s] for s in (3, 4, 5)]
    assert checksums(resumed.state) == crash.checksums[6]
    # Saving into the directory again first removes the partial save.
    writer = Checkpoints(directory)
    assert writer.discarded == [f"6{PARTIAL}"]
    writer.save(resumed, BATCHES)
    writer.wait()
    assert writer.steps() == [3, 6] and writer.partial() == []


@pytest.mark.slow
def test_resume_from_the_command_line_after_a_crash(tmp_path: Path) -> None:
    """The killed run compiled with the compiler options it was given; its checkpoints record
    them, so the run resumed from the command line compiles the same step and redoes the lost
    steps bit for bit."""
    directory = tmp_path / "crash"
    crash = cli.crash_during_save(
        directory, steps=4, save_every=2, devices=4, batch_size=8, compiler_options=FAST_COMPILE
    )
    record = Checkpoints(directory, create=False).record()
    assert record.options["compiler_options"] == FAST_COMPILE
    out = cli.run("train", str(directory), "--steps", "4", "--save-every", "2",
                  "--batch-size", "8", devices=4)  # fmt: skip
    assert [e.step for e in events.read(out, events.Resumed)] == [2]
    redone = {e.step: e.loss for e in events.read(out, events.Step)}
    assert redone == {2: crash.losses[2], 3: crash.losses[3]}
    assert {e.step: e.sums for e in events.read(out, events.Checksums)}[4] == crash.checksums[4]
    assert np.isfinite(list(redone.values())).all()


@pytest.mark.slow
def test_an_interleaved_run_resumes_unpipelined_and_under_another_schedule(tmp_path) -> None:
    """A pipeline holding its layers in rounds saves them as one plain stack, in the model's
    order; restored without a pipeline, or in other rounds on another mesh, the state is the
    saved one bit for bit, and training goes on as it would have."""
    cfg, mesh = TINY.replace(layers=8, scan_layers=True), pipeline.pipeline_mesh(4)
    schedule = interleaved(4, 4, 2)
    rules = pipeline.rules_for(mesh)
    model = pipeline.placed(create(cfg), mesh, virtual=2)
    trainer = Trainer.create(
        model, adamw(), rules, mesh, dropout=False, grads_fn=pipeline.grads_fn(schedule, mesh)
    )
    trainer.train(BATCHES, 1)
    saved = checksums(trainer.state)
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(trainer, BATCHES)
        checkpoints.wait()
        stored = checkpoints.saved_arrays()
        assert stored["model/blocks/mlp/up"][0] == (8, cfg.embed, cfg.mlp)  # the plain stack
        plain = checkpoints.restore(
            Transformer.from_config, adamw(), DP, strategy_mesh(DP), TrainOptions(dropout=False)
        )
        other = pipeline.pipeline_mesh(2)
        four = interleaved(2, 4, 4)
        options = TrainOptions(dropout=False, grads_fn=pipeline.grads_fn(four, other))
        structure = pipeline.placed(create(cfg), other, virtual=4)
        rounds = checkpoints.restore(structure, adamw(), pipeline.rules_for(other), other, options)
    up = rounds.model().blocks.mlp.up
    assert up.shape == (4, 2, cfg.embed, cfg.mlp)
    for shard in up[...].addressable_shards:  # stage d holds layers d, d + 2, d + 4, d + 6
        d = list(other.devices.flat).index(shard.device)
        assert sorted(np.arange(8).reshape(4, 2)[shard.index[:2]].flat) == [d, d + 2, d + 4, d + 6]
    assert checksums(plain.state) == checksums(rounds.state) == saved
    expected = trainer.train(BATCHES, 2)
    for resumed in (plain, rounds):
        np.testing.assert_allclose(resumed.train(BATCHES, 2), expected, rtol=0, atol=1e-5)


def test_a_record_from_another_version_is_refused_with_the_reason(run) -> None:
    fields = sealed(run["checkpoints"].record(8))
    assert record_from({**fields, "layer_order": None}, 8) == record_from(fields, 8)
    with pytest.raises(CheckpointMismatchError, match="a pipeline's layers in a permuted order"):
        record_from({**fields, "layer_order": [0, 2, 1, 3]}, 8)
    newer = {k: v for k, v in fields.items() if k != "seal"} | {"x": 1}
    with pytest.raises(
        CheckpointMismatchError, match=r"fields this nnxscale does not know, \['x'\]"
    ):
        record_from({**newer, "seal": seal(newer)}, 8)
    with pytest.raises(CorruptCheckpointError, match="altered after it was written"):
        record_from({**fields, "ema_decay": 0.5}, 8)
    with pytest.raises(CorruptCheckpointError, match="has no seal"):
        record_from(dataclasses.asdict(run["checkpoints"].record(8)), 8)


def program_text(compiled: jax.stages.Compiled) -> str:
    """The compiled program's instructions, without the source lines that traced them."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    return "\n".join(line for line in text.splitlines() if line.startswith(("%", "ENTRY", " ")))


@pytest.mark.slow
def test_a_restored_run_compiles_the_program_that_saved_it(tmp_path: Path) -> None:
    """The options travel with the checkpoint: restored without them, the step is the saved
    run's program, to the letter; a loss function of the run's own must be given again."""
    mesh = strategy_mesh(FSDP, 4)
    options = TrainOptions(dropout=False, micro_batches=2, activations=False,
                           compiler_options=FAST_COMPILE)  # fmt: skip
    trainer = Trainer.create(create(TINY), adamw(), FSDP, mesh, options)
    batch = trainer.place_batch(trainer.batch(BATCHES))
    saved = program_text(trainer.compile(batch))
    with Checkpoints(tmp_path / "plain") as checkpoints:
        checkpoints.save(trainer)
        checkpoints.wait()
        assert checkpoints.record().options["micro_batches"] == 2
        resumed = checkpoints.restore(Transformer.from_config, adamw(), FSDP, mesh)
    assert resumed.options == options
    assert program_text(resumed.compile(batch)) == saved
    own = Trainer.create(create(TINY), adamw(), FSDP, mesh, options, loss_fn=next_token_loss)
    with Checkpoints(tmp_path / "own") as checkpoints:
        checkpoints.save(own)
        checkpoints.wait()
        with pytest.raises(CheckpointMismatchError, match=r"its own loss_fn.*next_token_loss"):
            checkpoints.restore(Transformer.from_config, adamw(), FSDP, mesh)
        again = checkpoints.restore(
            Transformer.from_config, adamw(), FSDP, mesh, loss_fn=next_token_loss
        )
    assert again.options == own.options


def test_a_restore_reads_every_chunk_a_shard_overlaps() -> None:
    """A chunk is read whole: a shard cut across the saved chunks reads a piece of each, one
    that the chunks tile reads its own."""
    mesh = make_mesh((4, 2), ("data", "model"))

    def placed(shape, *spec):
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)

    columns = placed((64, 256), None, "model")  # device 0: all rows, columns 0-127
    assert chunks_read((8, 256), columns) == [(row, 0) for row in range(8)]
    assert chunks_read((8, 128), columns, device=1) == [(row, 1) for row in range(8)]
    rows = placed((64, 256), "data", None)  # device 0: rows 0-15
    assert chunks_read((8, 256), rows) == [(0, 0), (1, 0)]
    assert chunks_read((64, 256), rows, device=7) == [(0, 0)]  # one chunk holds it all
    assert chunks_read((), placed(())) == [()]
    with pytest.raises(ValueError, match="differ in dimensions"):
        chunks_read((8,), rows)
    two = make_mesh((2,), ("data",), devices=jax.devices()[:2])
    held = jax.ShapeDtypeStruct(
        (4,),
        np.float32,
        sharding=jax.sharding.NamedSharding(two, jax.sharding.PartitionSpec("data")),
    )
    with pytest.raises(ValueError, match="holds no shard"):
        chunks_read((2,), held, device=5)


@pytest.mark.parametrize("url", ["s3://bucket/run", "az://container/run"])
def test_object_storage_other_than_gcs_is_refused_before_anything_is_written(
    url, tmp_path, monkeypatch
) -> None:
    """gs:// is written (tests/test_buckets.py); elsewhere Orbax would finish a save by a
    rename that object storage does by copying, so the URL is refused, not made a folder."""
    monkeypatch.chdir(tmp_path)  # a URL taken for a local path would write a folder here
    scheme = url.split("://")[0]
    with pytest.raises(NoCheckpointError, match=rf"object storage \({scheme}://\).*renaming"):
        Checkpoints(url)
    assert list(tmp_path.iterdir()) == []


def test_finishing_saves_at_program_end_can_be_turned_off(tmp_path) -> None:
    """By default an open directory is closed as the main module ends (its saves finished);
    `finish_at_exit=False` leaves closing it to its owner (ARCHITECTURE.md lists the switch)."""
    from nnxscale.checkpoint import store

    with (
        Checkpoints(tmp_path / "a") as watched,
        Checkpoints(tmp_path / "b", finish_at_exit=False) as left,
    ):
        assert watched in store._OPEN and left not in store._OPEN
