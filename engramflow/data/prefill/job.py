"""prefill-job: next-token log-probabilities for every prompt of a Parquet/JSONL dataset.

Replica mode (default): Ray Data reads the input and feeds a pool of `PrefillReplica` actors
(one model replica each: an `Engine`, or a `Pipeline` with `stages > 1`). Pipeline mode
(`pipeline=True`): the driver feeds one `Pipeline` of `stages` stages with `in_flight` prompts
at once (`PipelinePrefill`), for a model that needs its blocks split over devices. Either way
the driver streams the output batches into one Parquet file, written atomically
(`AtomicParquetWriter`). One output row per input row;
a bad row carries its reason in `error` and the job goes on. `resume=True` keeps the rows of
an earlier (interrupted) output whose id names exactly one input row, makes every other row
again, and writes the union: the same rows as one uninterrupted run (ids compare as strings;
duplicate ids are allowed, each row gets its own output; blank JSONL lines are not rows).

An interrupted run (Ctrl-C, a failed replica) that finished some rows leaves a valid Parquet
of the rows so far at the output path (and says so on stderr): run again with `resume=True`.
Output rows are in completion order, not input order (replicas finish batches out of order).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import ray
import ray.data
from ray.exceptions import RayError

from engramflow.data.access.stats import cpus_per_actor
from engramflow.data.prefill.atomic_parquet import AtomicParquetWriter
from engramflow.data.input import input_format, is_uri, read_input, resolved
from engramflow.data.prefill.prompts import RowSpec
from engramflow.data.prefill.replica import PrefillReplica
from engramflow.data.prefill.resume import done_ids, input_id_counts, previous_rows, resumable_rows
from engramflow.data.rows import error_kind
from engramflow.data.prefill.schema import output_schema
from engramflow.errors import EngramflowError
from engramflow.io.atomic import check_makeable, missing_dirs, remove_made_dirs
from engramflow.pipeline.config import PipelineConfig, check_known
from engramflow.pipeline.faults import one_line, user_error
from engramflow.pipeline.ray_address import ensure_ray
from engramflow.validate import check_int


def prefill_job(config: PipelineConfig | str | Path, input_path, output, *, text_column: str | None = None,
                ids_column: str | None = None, id_column: str = "id", batch_size: int = 16, concurrency: int = 1,
                resume: bool = False, top_k: int = 5, progress: bool = True, pipeline: bool = False,
                share_prefix: bool = False, **options) -> dict:
    """Run the job; returns a JSON-able summary. `config`: the model (a PipelineConfig, or a
    checkpoint and PipelineConfig.build's keywords: stages, backbone, device, in_flight, ...).
    With one stage (replica mode) each replica is an Engine of `config.engine`. Uses the running
    Ray, or starts a local one (and stops it afterwards). Bad arguments, a bad checkpoint or an
    unwritable output raise EngramflowError on the driver before Ray Data starts; a replica that
    still fails to start ends the job with one EngramflowError line. `in_flight` (pipeline mode):
    prompts in flight, default one per stage."""
    from engramflow.io.checkpoint import Checkpoint

    if isinstance(config, PipelineConfig):
        check_known(options)
    else:
        config = PipelineConfig.build(config, **options)
    stages = config.stages
    if text_column is not None and ids_column is not None:
        raise EngramflowError("give either a text column or an ids column, not both")
    for name, value in (("batch_size", batch_size), ("concurrency", concurrency), ("top_k", top_k)):
        check_int(name, value, 1)
    if pipeline and concurrency != 1:
        raise EngramflowError(f"pipeline mode drives one pipeline; concurrency={concurrency} is for replica mode")
    if config.in_flight is not None and not pipeline:
        raise EngramflowError("in_flight applies to pipeline mode (pipeline=True)")
    if is_uri(output):
        raise EngramflowError(f"the output must be a local path (it is written atomically by rename), got {output}")
    is_ids = ids_column is not None
    column = ids_column if is_ids else (text_column or "text")
    if column == id_column:
        raise EngramflowError(f"the id column and the prompt column are both {column!r}")
    output = check_output(Path(output))
    checkpoint = config.engine.checkpoint
    ckpt = Checkpoint(checkpoint)  # a bad checkpoint fails here, not in every replica
    try:
        backbone = check_model(ckpt, config.engine.backbone, stages)
    finally:
        ckpt.close()
    model = dataclasses.replace(config, engine=dataclasses.replace(config.engine, backbone=backbone))
    cfg = ckpt.config
    schema = output_schema(cfg.engram_layer_ids)
    input_path = resolved(input_path)
    input_format(input_path)  # a missing input or an unknown format fails here, before Ray starts
    kept = previous_rows(output, schema) if resume else schema.empty_table()

    spec = RowSpec(column, is_ids, id_column, top_k, share_prefix=share_prefix)
    made = make_output_dir(output)
    done = started = False
    try:
        # replica mode: one spare CPU for the read tasks; pipeline mode: its actors place themselves
        started = ensure_ray(num_cpus=os.cpu_count() if pipeline else concurrency + 1)
        try:
            ds, jsonl = read_input(input_path, [id_column, column])
            if resume:  # keep the earlier rows an id matches to exactly one input row
                kept = resumable_rows(kept, input_id_counts(ds, id_column, jsonl))
            spec = dataclasses.replace(spec, skip_ids=frozenset(done_ids(kept)), jsonl=jsonl)
            total = ds.count() if progress else None  # the bar's total: every input row has one output row
            if pipeline:
                written = run_pipeline(ds, model, spec, batch_size,
                                       lambda batches: write_output(output, schema, kept, batches, progress, total))
            else:
                results = run_replicas(ds, model, spec, concurrency, batch_size)
                written = write_output(output, schema, kept,
                                       results.iter_batches(batch_format="pyarrow", batch_size=None), progress, total)
        except RayError as e:  # e.g. a replica that could not be built: its own message, one line
            raise job_error(e) from None
        done = True
        return written | {"checkpoint": checkpoint, "input": input_path, "column": column,
                          "concurrency": concurrency, "stages": stages, "backbone": backbone,
                          "mode": "pipeline" if pipeline else "replicas"}
    finally:
        if started:
            ray.shutdown()
        if not done and not output.exists():
            remove_made_dirs(made)  # directories this run made for an output it never wrote


def check_output(output: Path) -> Path:
    """The output path, checked before any work: not a directory, and inside a directory that
    exists (or can be made below one that does) and is writable. Nothing is created here."""
    output = output.absolute()
    if output.is_dir():
        raise EngramflowError(f"the output {output} is a directory; give a file path (e.g. OUT.parquet)")
    if output.exists() and not output.is_file():
        raise EngramflowError(f"the output {output} exists and is not a regular file")
    check_makeable(output.parent, f"the output {output}")
    return output


def make_output_dir(output: Path) -> list[Path]:
    """Make the output's missing directories and prove the directory writable with a probe
    file (removed at once); the directories made."""
    made = missing_dirs(output.parent)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".probe", dir=output.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        remove_made_dirs(made)
        raise EngramflowError(f"the output {output} cannot be written: {e.strerror or e}") from None
    return made


def check_model(ckpt, backbone: str | None, stages: int) -> str:
    """What every replica will build, checked once on the driver (headers and small tensors,
    nothing the size of the model): the token map, the stage split, the wkv weights' values and
    the backbone's tensors (V4.1: the whole name set, dtypes and shapes; the reference and
    emulated backbones, which are toy-sized or weightless: built here). Returns the backbone."""
    from engramflow.io.checkpoint import engram_names
    from engramflow.memory.history import SessionHistory
    from engramflow.model.backbones import KINDS, backbone_of, check_backbone_names, make_backbone, stage_blocks

    backbone = backbone or backbone_of(ckpt.raw_config)
    if backbone not in KINDS:
        raise EngramflowError(f"unknown backbone {backbone!r}; choose one of {', '.join(KINDS)}")
    SessionHistory.from_checkpoint(ckpt)
    stage_blocks(ckpt, stages)
    ckpt.verify_values([n for layer in ckpt.config.engram_layer_ids
                        for n in (engram_names(layer)["wkv.weight"], engram_names(layer)["wkv.scale"])
                        if n in ckpt.tensors], progress=False)
    try:
        if backbone == "v41":
            if check_backbone_names(ckpt) is None:
                raise EngramflowError(f"{ckpt.root}: the v41 backbone needs a V4.1 config.json")
        else:
            make_backbone(backbone, ckpt, range(ckpt.config.n_layers), "cpu", 0.0)
    except EngramflowError:
        raise
    except Exception as e:  # a constructor's own complaint about the weights: one line, named
        raise EngramflowError(f"{ckpt.root}: the {backbone} backbone cannot be built from it: {one_line(e)}") from None
    return backbone


class CheckedReplica(PrefillReplica):
    """A replica whose construction error (bad input only a replica finds: e.g. a NaN in a
    backbone weight, read at first use) is kept and raised by its first batch. Ray Data then
    reports it as a user-code error with the replica's own message, instead of an actor that
    died during initialisation (which Ray Data prints as an internal error with a full trace)."""

    def __init__(self, model: PipelineConfig, rows: RowSpec):
        self._init_error = None
        try:
            super().__init__(model, rows)
        except EngramflowError as e:
            self._init_error = str(e)

    def __call__(self, batch):
        if self._init_error is not None:
            raise EngramflowError(self._init_error)
        return super().__call__(batch)


_RELAYED = re.compile(r"engramflow\.(?:[\w.]+\.)?\w*Error: (.+)")
_RAISED = re.compile(r"^(?!ray\.)[\w.]*(?:Error|Exception): \S")  # a replica's own exception line


def job_error(e: BaseException) -> EngramflowError:
    """One line for a failed job: the error a replica raised (from Ray's chain of causes or the text it relays)."""
    seen, todo = set(), [e]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        if isinstance(c, EngramflowError) and not isinstance(c, RayError) and c.args:
            return EngramflowError(str(c.args[0]).strip().splitlines()[0])
        todo += [c.__cause__, c.__context__, getattr(c, "cause", None)]
    if (err := user_error(e)) is not None:
        return err
    for line in reversed(str(e).splitlines()):
        if m := _RELAYED.search(line):
            return EngramflowError(m.group(1).strip())
    raised = next((l.strip() for l in str(e).splitlines() if _RAISED.match(l)), None)  # before Ray Data wraps it
    return EngramflowError(f"prefill-job failed in a replica: {raised}" if raised
                           else f"prefill-job failed: {one_line(e)}")


def run_replicas(ds, model: PipelineConfig, spec: RowSpec, concurrency: int, batch_size: int):
    """The lazy Dataset of output batches from `concurrency` replicas."""
    # small blocks, so even a single input file is spread over every replica
    return ds.repartition(target_num_rows_per_block=batch_size).map_batches(
        CheckedReplica, batch_size=batch_size, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=concurrency),  # `concurrency=` is deprecated since 2.51
        num_cpus=cpus_per_actor(concurrency), num_gpus=1 if model.engine.device.startswith("cuda") else 0,
        fn_constructor_kwargs={"model": model, "rows": spec})


def run_pipeline(ds, model: PipelineConfig, spec: RowSpec, batch_size: int, write) -> dict:
    """Pipeline mode: one Pipeline, fed by the driver; `write(batches)` consumes its output."""
    from engramflow.data.prefill.pipeline_mode import PipelinePrefill
    from engramflow.io.token_map import load_tokenizer
    from engramflow.pipeline.pipeline import Pipeline

    tokenizer = load_tokenizer()
    # read the prompts before the pipeline's actors take the CPUs (a projection actor asks for
    # every free one); a read task left waiting for a CPU would stall the job for good
    ds = ds.materialize()
    runner = Pipeline.launch(model)
    try:
        job = PipelinePrefill(runner, lambda text: tokenizer.encode(text).ids, spec,
                              in_flight=runner.in_flight_default, out_rows=batch_size)
        return write(job.run(ds.iter_batches(batch_format="pyarrow", batch_size=batch_size)))
    finally:
        runner.shutdown()


def write_output(output: Path, schema, kept, batches, progress: bool, total: int | None = None) -> dict:
    """Stream kept rows then the new batches into the output; the counts of what was written."""
    from tqdm import tqdm

    errors: Counter = Counter()
    tokens = new_rows = 0
    t0 = time.perf_counter()
    with AtomicParquetWriter(output, schema) as writer, \
            tqdm(desc="prefill-job", unit="row", total=total, initial=kept.num_rows, disable=not progress) as bar:
        writer.write(kept)
        try:
            for batch in batches:
                writer.write(batch)
                writer.publish_partial = True  # from now on an interruption keeps the work done
                new_rows += batch.num_rows
                failed = batch.column("error").to_pylist()
                errors.update(error_kind(e) for e in failed if e is not None)
                tokens += sum(n for n, e in zip(batch.column("n_tokens").to_pylist(), failed) if e is None)
                bar.update(batch.num_rows)
                bar.set_postfix(failed=sum(errors.values()), tokens=tokens)
        except BaseException:
            if writer.publish_partial:
                print(f"prefill-job: stopped after {new_rows} new rows; {writer.rows} rows saved to {output}; "
                      "run again with --resume to finish", file=sys.stderr)
            raise
    seconds = time.perf_counter() - t0
    return {"out": str(output), "rows": writer.rows, "rows_kept": kept.num_rows, "rows_new": new_rows,
            "rows_failed": sum(errors.values()), "errors": dict(errors), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}
