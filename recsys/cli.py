"""Command line: ``recsys train``, ``config``, ``preprocess``, ``export``, ``predict``,
``serve``, ``eval``, ``report`` and ``plan``.

    recsys train --config configs/dlrm_synthetic.toml [--section.key=value ...]
    recsys config --config configs/dlrm_synthetic.toml [--section.key=value ...]   # resolved TOML
    recsys config --reference                                                   # all keys
    recsys config --models                 # model.name: built-ins, installed entry points
    recsys preprocess --format criteo --input train.txt.gz --output data/criteo     # ETL
    recsys export --checkpoint runs/dlrm --output model.pt2              # torch.export program
    recsys predict --model model.pt2 --input test.parquet --output scores.parquet
    recsys predict --model base.pt2 --deltas runs/dlrm/deltas --input ... --output ...
    recsys report runs/a runs/b [--output compare.png]      # loss / AUC / speed of runs, PNG
    recsys serve --model model.pt2 [--deltas runs/dlrm] [--port 8080]   # online, KServe v2
    recsys plan --config configs/dlrm_dcnv2_mlperf.toml --world-size 64   # plan + predicted step

User errors (a missing file, a config typo, bad input data) print one ``recsys: error: ...`` line
and exit with status 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from collections.abc import Sequence

from recsys._files import describe_os_error
from recsys.cli_plan import add_plan_arguments, run_plan
from recsys.cli_preprocess import PREPROCESS_FLAGS, run_preprocess
from recsys.config import config_reference, load_config, names_its_run, to_toml


def _parser() -> argparse.ArgumentParser:
    """The ``recsys`` parser: one ``_add_<command>`` per subcommand, in ``--help`` order."""
    parser = _Parser(
        prog="recsys",
        description="Train recommendation models. Any config key can be overridden with "
        "--section.key=value (see `recsys config --reference`).",
        epilog=_epilog("recsys train --config configs/dlrm_synthetic.toml --train.batch_size=4096"),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train(commands)
    _add_config(commands)
    _add_preprocess(commands)
    _add_export(commands)
    _add_predict(commands)
    _add_serve(commands)
    _add_eval(commands)
    _add_report(commands)
    _add_plan(commands)
    return parser


def help_pages() -> dict[str, str]:
    """``recsys --help`` and every command's ``--help`` (wrapped to the terminal's width, or
    ``COLUMNS``), by command (``""``: ``recsys`` itself), in ``--help`` order: the docs'
    command-line page."""
    parser = _parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    pages = {"": parser.format_help()}
    pages.update((name, sub.format_help()) for name, sub in commands.choices.items())
    return pages


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps each line of a description or epilog on its own, so explicit line breaks stay;
    indented lines (example commands) are printed as they are."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            indent + line
            if not line.strip() or line.startswith(" ")
            else textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
            for line in text.splitlines()
        )


class _Parser(argparse.ArgumentParser):
    """The parser of ``recsys`` and (as argparse builds subparsers of the parent's class) of
    every subcommand: help formatted by :class:`_HelpFormatter`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


_OVERRIDES_HELP = (
    "config keys: any key is set on the command line as --section.key=value, e.g. "
    "--train.batch_size=4096, --data.synthetic.zipf_alpha=1.2 or "
    "--model.over_arch_layer_sizes=128,64,1 (values are read as TOML: 64, 1e-3, true, "
    "[64, 32]; a list may also be written 64,32). The command line wins over the --config "
    "recipe, the recipe over the defaults; an unknown key is an error naming the closest one."
)
_REFERENCE_HELP = (
    "reference: `recsys config --reference` prints every key with its type, default and "
    "meaning (the configuration reference of the docs)."
)
_NO_OVERRIDES_HELP = "This command takes no config keys (--section.key=value)."


def _epilog(example: str, keys: str = _OVERRIDES_HELP) -> str:
    """The end of a command's ``--help``: how config keys are set (``keys``), where they are
    all described, and one example command line (a long one continued with a backslash)."""
    reference = "" if keys == _NO_OVERRIDES_HELP else f"\n{_REFERENCE_HELP}"
    return f"{keys}{reference}\n\nexample:\n  {example}"


def _add_train(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train",
        help="train a model from a TOML recipe",
        description="Train a model on one process, or on each process of torchrun "
        "--nproc-per-node=N -m recsys train ...; the run directory (run.dir, default "
        "runs/<name>) gets config.toml, metrics.jsonl and checkpoints/.",
        epilog=_epilog(
            "recsys train --config configs/dlrm_synthetic.toml --train.batch_size=4096 \\\n"
            "      --model.embedding_dim=32 --run.dir=runs/dlrm_dim32"
        ),
    )
    train.add_argument("--config", help="TOML recipe, e.g. configs/dlrm_synthetic.toml")


def _add_config(commands: argparse._SubParsersAction) -> None:
    show = commands.add_parser(
        "config",
        help="print the resolved config, or the key reference",
        epilog=_epilog(
            "recsys config --config configs/dlrm_synthetic.toml --train.batch_size=4096"
        ),
    )
    show.add_argument("--config", help="TOML recipe")
    show.add_argument("--reference", action="store_true", help="print every key with its doc")
    show.add_argument(
        "--models",
        action="store_true",
        help="list the model.name values: built-in models and installed entry points",
    )


def _add_preprocess(commands: argparse._SubParsersAction) -> None:
    prep = commands.add_parser(
        "preprocess",
        help="raw Criteo TSV / parquet / CSV -> parquet + metadata for training",
        description="Each flag sets the [preprocess] key of the same name; any other key is "
        "--preprocess.key=value (see `recsys config --reference`).",
        epilog=_epilog(
            "recsys preprocess --format criteo --input data/raw/train.txt \\\n"
            "      --output data/criteo --preprocess.freq_threshold=3",
            keys="config keys: any [preprocess] key is set as --preprocess.key=value, e.g. "
            "--preprocess.freq_threshold=3; the command line wins over the --config file, the "
            "file over the defaults; an unknown key is an error naming the closest one.",
        ),
    )
    prep.add_argument("--config", help="TOML file with a [preprocess] section")
    for flag, help_text in PREPROCESS_FLAGS.items():
        prep.add_argument(f"--{flag}", help=help_text)


def _add_export(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="checkpoint -> one torch.export program (.pt2) that scores batches",
        description="Writes a torch.export ExportedProgram (torch.export.save); load it with "
        "torch.export.load(PATH).module() or recsys.serve.export.load_exported(PATH). Its "
        "forward takes dense f32[B, N_dense], ids int64[L] and bag lengths int64[F*B] "
        "(key-major, as a KeyedJaggedTensor) and returns click probabilities f32[B, T].",
        epilog=_epilog(
            "recsys export --checkpoint runs/dlrm_synthetic --output model.pt2",
            keys=_NO_OVERRIDES_HELP,
        ),
    )
    export.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint directory, or a run directory (its newest checkpoint)",
    )
    export.add_argument(
        "--output",
        required=True,
        help="file to write, e.g. model.pt2; with --format triton, the model repository "
        "directory (the model goes to OUTPUT/NAME/)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace --output when it exists")
    export.add_argument(
        "--format",
        choices=("pt2", "triton"),
        default="pt2",
        help="pt2 (default): a torch.export program; triton: a Triton Inference Server model "
        "repository (config.pbtxt and an AOTInductor package, platform torch_aoti)",
    )
    export.add_argument("--name", default="recsys", help="with --format triton: the model name")
    export.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="with --format triton: where the compiled package runs (cuda: compile on a GPU "
        "machine, for a GPU server)",
    )
    export.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="sequence models (sasrec, hstu): the program returns each history's top K items "
        "(1 <= K <= the items the model ranks; default 100, or every item when fewer)",
    )


def _add_predict(commands: argparse._SubParsersAction) -> None:
    score = commands.add_parser(
        "predict",
        help="score parquet files with an exported model",
        description="Reads the columns the model was trained on (multi-hot features as list "
        "columns) and writes one float column score_<label> per task, in input order, plus "
        "the label columns when the input has them.",
        epilog=_epilog(
            "recsys predict --model model.pt2 --input data/criteo/test --output scores.parquet",
            keys=_NO_OVERRIDES_HELP,
        ),
    )
    score.add_argument("--model", required=True, help="a .pt2 file from recsys export")
    score.add_argument("--input", required=True, help="parquet file, directory or glob")
    score.add_argument(
        "--output", required=True, help="parquet file to write (not one of the inputs)"
    )
    score.add_argument("--overwrite", action="store_true", help="replace --output when it exists")
    score.add_argument(
        "--transform",
        action="store_true",
        help="the input is raw data: transform it first with the workflow fitted on the "
        "model's training data (recsys preprocess --apply)",
    )
    score.add_argument(
        "--data", help="with --transform: the model's preprocessed training data, if moved"
    )
    score.add_argument(
        "--format", help="with --transform: criteo | parquet | csv, if not the training data's"
    )
    score.add_argument(
        "--deltas",
        metavar="DIR",
        help="the deltas directory (<run dir>/deltas), or the run directory, of the run the "
        "model was exported from: score with its dynamic tables brought forward by the deltas "
        "written after the exported checkpoint (dense layers stay the export's); deltas of "
        "another run, or of a branch resumed before that checkpoint, are refused",
    )
    score.add_argument(
        "--batch-size", type=int, default=8192, help="rows per forward call (default 8192)"
    )
    score.add_argument(
        "--cache-rows",
        type=int,
        help="an export with tiered tables: rows of each one's cache of hot rows (default: the "
        "training run's cache size; the scores do not depend on it)",
    )
    score.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="a sequence model's export: the top K items of each history (default: the "
        "export's K; at most that). With --transform its 'items' column holds raw item values "
        "(as the interaction log names them), encoded as the training data was",
    )


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve an exported model online (Open Inference Protocol on MLServer)",
        description="Answers POST /v2/models/NAME/infer (KServe v2 tensors dense [B, N], "
        "lengths [B, F], values [L]) and POST /predict (named features as JSON), batching "
        "concurrent requests; /v2/health/ready turns ready once the tables are loaded; "
        "Prometheus metrics on --metrics-port. With --deltas the dynamic tables follow the "
        "run's deltas, each applied atomically; a new base (the --model file replaced by a new "
        "export, or a run's latest checkpoint) is loaded the same way, without a restart; "
        "every response says the step it was served at.",
        epilog=_epilog(
            "recsys serve --model model.pt2 --deltas runs/dlrm_synthetic --port 8080",
            keys=_NO_OVERRIDES_HELP,
        ),
    )
    serve.add_argument(
        "--model",
        required=True,
        help="a .pt2 file from recsys export, or a checkpoint / run; followed while serving "
        "(a replaced file, a run's newer latest checkpoint)",
    )
    serve.add_argument(
        "--deltas",
        metavar="DIR",
        help="the deltas directory (or run directory) of the run the model comes from: apply "
        "each new delta while serving; one that does not continue the served step is refused",
    )
    serve.add_argument("--name", default="recsys", help="model name in /v2/models/NAME")
    serve.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every interface)"
    )
    serve.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port (default --port + 1)")
    serve.add_argument("--metrics-port", type=int, help="metrics port (default --port + 2)")
    serve.add_argument(
        "--max-batch-size", type=int, default=64, help="most requests merged (default 64)"
    )
    serve.add_argument(
        "--max-wait-ms",
        type=float,
        default=0.0,
        help="how long an idle server waits to merge requests (default 0: requests arriving "
        "while a batch is scored form the next one)",
    )
    serve.add_argument("--max-ids", type=int, default=256, help="most ids per bag (default 256)")
    serve.add_argument(
        "--max-body-mb", type=float, default=16.0, help="largest request body (default 16 MiB)"
    )
    serve.add_argument(
        "--poll-seconds",
        type=float,
        default=1.0,
        help="how often --deltas and --model are looked at (default 1)",
    )
    serve.add_argument(
        "--cache-rows",
        type=int,
        help="a model with tiered tables (host or disk tier): rows of each one's in-memory "
        "cache of hot rows, in front of its row store (default: the training run's cache size)",
    )
    serve.add_argument(
        "--compile",
        choices=("off", "aoti"),  # recsys.serve.compiled_program.COMPILE_CHOICES (torch-free here)
        default="off",
        help="aoti: score with the export compiled ahead of time by AOTInductor (C++; a faster "
        "call, none of the GIL hand-offs of the op-by-op program; scores within float rounding "
        "of predict's; compiled once per program and cached: tens of seconds the first time; "
        "not with --deltas or tiered tables). Default off: the exported program, bitwise as "
        "recsys predict",
    )
    serve.add_argument(
        "--transform",
        action="store_true",
        help="the JSON route takes raw values (as in the data the model's training data was "
        "preprocessed from), transformed by its fitted workflow exactly as predict --transform",
    )
    serve.add_argument(
        "--data",
        metavar="DIR",
        help="with --transform: the preprocessed directory the model was trained on (default: "
        "its config's data.path)",
    )


def _add_report(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report",
        help="compare runs: loss, AUC, throughput and step time in one PNG, plus a table",
        description="Reads each RUN_DIR's metrics.jsonl and draws, runs overlaid and named: "
        "train loss and valid logloss, valid / test AUC (and the oracle's on synthetic data), "
        "samples/s against steps, and where a step's time goes (data, forward, backward, "
        "optimizer, collectives) when the runs logged it. Prints a table: per run the last "
        "valid AUC, test AUC and logloss, mean samples/s and mean ms per step part.",
        epilog=_epilog(
            "recsys report runs/dlrm_fp32 runs/dlrm_bf16 --output compare.png",
            keys=_NO_OVERRIDES_HELP,
        ),
    )
    report.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories written by recsys train"
    )
    report.add_argument(
        "--output",
        help="PNG file to write, replaced if it exists (default: <first RUN_DIR>/report.png)",
    )


def _export(args: argparse.Namespace) -> None:
    from recsys.checkpoint.io import resolve_checkpoint
    from recsys.serve.export import export_model

    start = time.perf_counter()
    checkpoint = resolve_checkpoint(args.checkpoint)
    if args.format == "triton":
        from recsys.serve.triton_export import export_triton

        if args.top_k is not None:
            raise ValueError("--top-k describes a sequence model's export: drop --format triton")
        target = export_triton(
            checkpoint, args.output, name=args.name, device=args.device, overwrite=args.overwrite
        )
        print(
            f"recsys: exported {checkpoint} to the Triton model repository {args.output} "
            f"({target}/config.pbtxt, {target}/1/model.pt2: AOTInductor, {args.device}) in "
            f"{time.perf_counter() - start:.1f} s"
        )
        print(f"serve it with: tritonserver --model-repository={args.output}")
        return
    if args.name != "recsys" or args.device != "cpu":
        raise ValueError("--name and --device describe a Triton export: add --format triton")
    output = export_model(checkpoint, args.output, overwrite=args.overwrite, top_k=args.top_k)
    megabytes = output.stat().st_size / 2**20
    print(
        f"recsys: exported {checkpoint} to {output} ({megabytes:.1f} MiB torch.export program) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    print(f"score with it: recsys predict --model {output} --input DATA.parquet --output OUT")


def _predict(args: argparse.Namespace) -> None:
    from recsys.serve.export import predict

    report = predict(
        args.model,
        args.input,
        args.output,
        args.batch_size,
        overwrite=args.overwrite,
        transform=args.transform,
        data=args.data,
        format=args.format,
        deltas=args.deltas,
        cache_rows=args.cache_rows,
        top_k=args.top_k,
    )
    tables = "" if report.deltas_step is None else f", dynamic tables at step {report.deltas_step}"
    print(
        f"recsys: scored {report.rows:,} rows of {report.files} file(s) into {report.output} "
        f"({', '.join(report.columns)}{tables}) in {report.seconds:.1f} s"
    )


def _serve(args: argparse.Namespace) -> None:
    import dataclasses

    from recsys.serve.online.server import ServeOptions, serve

    fields = {f.name for f in dataclasses.fields(ServeOptions)}
    serve(ServeOptions(**{k: v for k, v in vars(args).items() if k in fields}))


def _report(args: argparse.Namespace) -> None:
    from recsys.report import write_report

    report = write_report(args.run_dirs, args.output)
    print(report.table, end="")
    print(f"recsys: wrote {report.output}")


def _add_plan(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan",
        help="the sharding plan of a config on N ranks, flat and 2D, with predicted step time",
        description="Plans the config's tables for --world-size ranks as the trainer would "
        "(no process group, nothing table-sized allocated), flat and with the tables sharded "
        "inside each node and replicated across nodes (2D), and prints for each: the plan, "
        "memory per rank, bytes each rank sends per step inside and across nodes, and a "
        "predicted step time per component from the cluster's figures (a hardware preset or "
        "a topology file). A model, not a measurement.",
        epilog=_epilog(
            "recsys plan --config configs/dlrm_dcnv2_mlperf.toml --world-size 64 \\\n"
            "      --hardware h100_8x_ib400 --train.batch_size=8192"
        ),
    )
    add_plan_arguments(plan)


def _add_eval(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "eval",
        help="a checkpoint's test metrics (AUC / logloss, or HR@10 / NDCG@10 for next-item "
        "models) on a split of its data or of other preprocessed data",
        description="Evaluates like the trainer's final evaluation (same batches of "
        "train.eval_batch_size rows, same metrics): on the checkpoint's own data it reproduces "
        "the run's test metrics exactly. --data.path=DIR evaluates on other `recsys preprocess` "
        "output with the same features, table sizes, labels and vocabulary. Under torchrun "
        "--nproc-per-node=N -m recsys eval ... each rank scores its share and rank 0 prints.",
        epilog=_epilog(
            "recsys eval --checkpoint runs/day_0 --data.path=data/day_1 --output day_1.json",
            keys="config keys: any key of the checkpoint's config.toml but model.* is set as "
            "--section.key=value, e.g. --data.path=DIR, --train.eval_batch_size=4096 or "
            "--run.device=cpu.",
        ),
    )
    evaluate.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint directory, or a run directory (its newest checkpoint)",
    )
    evaluate.add_argument(
        "--split", choices=("train", "valid", "test"), default="test", help="default: test"
    )
    evaluate.add_argument("--output", help="also write the metrics as JSON to this file")


def _eval(args: argparse.Namespace, overrides: list[str]) -> None:
    import json
    from pathlib import Path

    from recsys._files import write_text_atomic
    from recsys.train.evaluate import evaluate_checkpoint

    output = Path(args.output) if args.output else None
    if output is not None and not output.parent.is_dir():
        raise FileNotFoundError(f"--output '{output}': directory '{output.parent}' not found")
    result = evaluate_checkpoint(args.checkpoint, overrides, args.split)
    if _rank() == 0:
        print(f"recsys: {result.summary()}")
        if output is not None:
            write_text_atomic(output, json.dumps(result.to_json(), indent=1) + "\n")


def _rank() -> int:
    """This process's rank under torchrun (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def _who() -> str:
    """``recsys``, or ``recsys (rank N)`` on the other ranks of a torchrun job (where every rank
    reports its own errors)."""
    rank = _rank()
    return f"recsys (rank {rank})" if rank else "recsys"


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        if args.command == "eval":
            _eval(args, overrides)
            return 0
        if args.command in ("export", "predict", "serve", "report"):
            if overrides:
                raise ValueError(f"unrecognized arguments: {' '.join(overrides)}")
            if args.command == "export":
                _export(args)
            elif args.command == "predict":
                _predict(args)
            elif args.command == "serve":
                _serve(args)
            else:
                _report(args)
            return 0
        if args.command == "config" and args.reference:
            print(config_reference(), end="")
            return 0
        if args.command == "config" and args.models:
            from recsys.build.registry import models_table

            print(models_table(), end="")
            return 0
        if args.command == "preprocess":
            run_preprocess(args, overrides)
            return 0
        if args.command == "plan":
            run_plan(args, overrides)
            return 0
        config = load_config(args.config, overrides)
        if args.command == "config":
            print(to_toml(config), end="")
            return 0
        from recsys.train.run_dir import unused_run_dir
        from recsys.train.stop import TrainingStopped
        from recsys.train.trainer import train

        if not names_its_run(args.config, overrides):  # a second `make train` trains again
            default = config.run.dir
            config.run.dir = str(unused_run_dir(config))
            if config.run.dir != default and _rank() == 0:
                print(
                    f"recsys: {default} holds an earlier run: this one writes to "
                    f"{config.run.dir} (--run.name or --run.dir names a run)",
                    file=sys.stderr,
                )
        try:
            train(config)
        except TrainingStopped as stopped:
            if _rank() == 0:  # every rank stopped at the same step, with the same checkpoint
                print(f"recsys: {stopped}", file=sys.stderr)
            return stopped.exit_code
        return 0
    except (ValueError, FileNotFoundError) as error:
        print(f"{_who()}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a full disk, a read-only directory, ...
        print(f"{_who()}: error: {describe_os_error(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("recsys: interrupted", file=sys.stderr)
        return 130
