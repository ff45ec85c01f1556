"""The `baton` command: run the service, operate it, and talk to it.

baton serve [--mode ...] [--prefill-replicas N] ...   deploy (starts Ray if needed)
baton generate "prompt" [--chat]                        stream a completion over gRPC
baton scale prefill|decode|aggregated N [--fixed]       resize one pool, live
baton status [--json]                                   pools, replicas, KV, hit rate
baton stop                                              remove the service (and the Ray it started)
baton drain --deadline-s S                              move this node's replicas away
baton generate --local "prompt"                         no service: an in-process engine

`--app NAME` on serve, generate, scale, status and stop names the Serve application, for
a cluster that runs several (default: the one application `baton serve` deploys).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

from serve_app.ops.bench import add_bench_args
from serve_app.ops.bench import bench as bench_endpoint
from serve_app.ops.generate import add_sampling_args, generate

log = logging.getLogger("baton")

# serve_app.config.DType's values (tests/test_cli.py holds them equal), spelled out so
# that building the parser imports neither pydantic, protobuf nor torch.
DTYPES = ("auto", "float32", "bfloat16", "float16")
# serve_app.config.Activations' values (tests/test_cli.py holds them equal), spelled out
# for the same reason.
ACTIVATIONS = ("exact", "int16", "int8")
ACTIVATIONS_HELP = (
    "how one-sequence decode matmuls from a GGUF model's weight blocks take their input: "
    "exact (the default: float32 throughout), int16 (rounded to 16 bits per block of 32: "
    "a faster single stream, greedy output parts from exact's at rare near-ties) or int8 "
    "(faster still; parts at near-ties often)"
)
# The bundled names are workers.model.BUNDLED_MODELS' (test_cli checks): spelled out here
# because importing that face would load torch, and `baton --help` must stay instant.
MODEL_HELP = (
    "a bundled model (smollm2-135m-instruct, the default, or gemma3-270m: fetched and "
    "converted on first use), a .gguf file or a Hugging Face model folder"
)


def _add_app_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--app",
        default=None,
        help="the Serve application, where the cluster runs several (default: baton)",
    )


def _app_name(args: argparse.Namespace) -> dict[str, str]:
    """The `app_name` keyword for service_ops, where --app names one."""
    return {"app_name": args.app} if args.app else {}


def _threads(text: str) -> int | str:
    """`--threads`: a count (PoolConfig checks its range), or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or auto, got {text!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton LLM inference service")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion and stream it to stdout")
    _add_app_arg(gen)
    gen.add_argument("prompt", help="the prompt, or the user message with --chat")
    gen.add_argument("--chat", action="store_true", help="render PROMPT with the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--address", default="localhost:9000", help="the service's gRPC address")
    gen.add_argument(
        "--api-key",
        default=os.environ.get("BATON_API_KEY"),
        help="for a service deployed with api_key_file (default: $BATON_API_KEY)",
    )
    gen.add_argument("--local", action="store_true", help="run an engine in this process")
    gen.add_argument(
        "--model",
        default=None,
        help=f"with --local: {MODEL_HELP}; without: the model the service must be serving",
    )
    gen.add_argument(
        "--dtype", choices=DTYPES, default=None, help="with --local: the engine's (default auto)"
    )
    gen.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="with --local: n-gram speculative decoding, up to N drafted tokens a step (0: off)",
    )
    gen.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default=None,
        help=f"with --local: {ACTIVATIONS_HELP}",
    )
    add_sampling_args(gen)

    serve = sub.add_parser("serve", help="deploy the service (joins RAY_ADDRESS or starts Ray)")
    serve.add_argument("--config", default=None, help="a JSON or YAML file of AppConfig fields")
    serve.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto', host:port); default RAY_ADDRESS, else a local head",
    )
    serve.add_argument("--model", default=None, help=MODEL_HELP)
    serve.add_argument("--mode", choices=["disaggregated", "aggregated"], default=None)
    for pool in ("prefill", "decode", "aggregated"):
        serve.add_argument(f"--{pool}-replicas", type=int, default=None)
        serve.add_argument(f"--{pool}-tp", type=int, default=None, help="tensor parallel size")
    serve.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="every pool's weights and KV cache (default auto: float32 on CPU, bfloat16 on "
        "GPU); bfloat16 about doubles batched throughput on CPUs with AMX or AVX512-BF16",
    )
    serve.add_argument(
        "--threads",
        type=_threads,
        default=None,
        help="every pool's torch threads per replica or TP rank: a number, or auto (the "
        "default: the machine's cores, shared step by step among the replicas busy on it)",
    )
    serve.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default=None,
        help=f"every pool's: {ACTIVATIONS_HELP}",
    )
    serve.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="where this command starts Serve (default 8000); Serve keeps its ports for "
        "every application while it runs",
    )
    serve.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="where this command starts Serve (default 9000); as --http-port",
    )
    serve.add_argument(
        "--host",
        default="0.0.0.0",
        help="the interface both APIs listen on where this command starts Serve (default "
        "all; 127.0.0.1 keeps them on this machine); the ingress's stats page and "
        "metrics listen on loopback only",
    )
    _add_app_arg(serve)
    serve.add_argument(
        "--route-prefix",
        default=None,
        help="where the HTTP API lives (default: / for the default application, /NAME "
        "for --app NAME)",
    )

    scale = sub.add_parser("scale", help="set one pool's replica count, without downtime")
    scale.add_argument("pool", choices=["prefill", "decode", "aggregated"])
    scale.add_argument("replicas", type=int)
    scale.add_argument(
        "--fixed",
        action="store_true",
        help="an autoscaled pool: keep it at REPLICAS and turn its autoscaling off",
    )
    _add_app_arg(scale)

    status = sub.add_parser("status", help="pools, replicas, queues, KV usage, prefix hits")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _add_app_arg(status)

    stop = sub.add_parser(
        "stop",
        help="remove the service; Serve too if nothing else runs on it, and Ray if "
        "`baton serve` started it on this machine",
    )
    _add_app_arg(stop)

    bench = sub.add_parser(
        "bench",
        help="load an OpenAI-compatible endpoint (Baton, vLLM, llama.cpp) and report "
        "TTFT / TPOT / ITL / E2E percentiles, throughput and goodput",
    )
    add_bench_args(bench)

    fetch = sub.add_parser(
        "fetch",
        help="fetch and convert models now, printing each folder (an image's build step)",
    )
    fetch.add_argument("models", nargs="*", default=["default"], help=MODEL_HELP)

    drain = sub.add_parser(
        "drain",
        help="drain this Ray node: Serve moves its replicas away, letting their streams "
        "finish (a worker pod's preStop hook)",
    )
    drain.add_argument(
        "--node-id", default=None, help="hex node id (default: this machine's only Ray node)"
    )
    drain.add_argument(
        "--deadline-s",
        type=int,
        required=True,
        help="seconds until the node is killed: how long to wait for its replicas to leave",
    )
    drain.add_argument("--address", default=None, help="the Ray cluster (default: auto)")
    return parser


def _serve(args: argparse.Namespace) -> int:
    from serve_app.app import validate
    from serve_app.ops import service_ops
    from serve_app.ops.serve_args import app_config_from_args

    config = app_config_from_args(args)
    validate(config)  # before a Ray head is started for a config that cannot deploy
    service_ops.connect(args.address, start_if_missing=True)
    log.info("deploying (%s mode); the first start loads the model", config.mode)
    where = _app_name(args)
    if args.app or args.route_prefix:
        where["route_prefix"] = args.route_prefix or f"/{args.app}"
    ingress = service_ops.deploy(
        config,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        http_host=args.host,
        **where,
    )
    grpc_service = f"baton.v1.Baton{f', metadata application={args.app}' if args.app else ''}"
    http_path = f"{where.get('route_prefix', '/').rstrip('/')}/v1"
    if ingress is None:
        log.info(
            "serving on the ports of the Serve that was already running (started outside "
            "Baton, e.g. by a RayService: its config has them): gRPC %s, OpenAI HTTP %s",
            grpc_service,
            http_path,
        )
    else:
        log.info(
            "serving: gRPC localhost:%d (%s), OpenAI HTTP http://localhost:%d%s",
            ingress.grpc_port,
            grpc_service,
            ingress.http_port,
            http_path,
        )
    return 0


def _scale(args: argparse.Namespace) -> int:
    from serve_app.ops import service_ops

    service_ops.connect()
    service_ops.scale(args.pool, args.replicas, fixed=args.fixed, **_app_name(args))
    log.info("%s pool scaled to %d replicas", args.pool, args.replicas)
    return 0


def _status(args: argparse.Namespace) -> int:
    from serve_app.ops import service_ops

    service_ops.connect()
    report = service_ops.status(**_app_name(args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from serve_app.ops.status_text import status_lines

        print("\n".join(status_lines(report)))
    # For scripts and probes: 1 while the application is not running (deploying,
    # unhealthy, failed), as the lines above say why.
    return 0 if report["status"] == "RUNNING" else 1


def _fetch(args: argparse.Namespace) -> int:
    from workers.model import check_model_source, resolve_model

    for model in args.models:  # all named well before any download starts
        check_model_source(model)
    for model in args.models:
        print(resolve_model(model))
    return 0


def _stop(args: argparse.Namespace) -> int:
    from serve_app.ops import service_ops

    service_ops.connect()
    stopped = service_ops.stop(**_app_name(args))
    if not stopped.app_deleted:
        log.info("no Baton application was deployed")
    if stopped.apps_left:
        log.info("Serve and Ray keep running: %s still deployed", ", ".join(stopped.apps_left))
    elif not stopped.local_head:
        log.info("Ray keeps running: `baton serve` did not start this cluster here")
    else:
        service_ops.stop_local_head()
        log.info("stopped the local Ray head `baton serve` started")
    return 0


def _drain(args: argparse.Namespace) -> int:
    from serve_app.ops.node_drain import drain

    result = drain(args.node_id, deadline_s=args.deadline_s, address=args.address)
    if result.drained:
        log.info("node %s drained in %.1fs", result.node_id, result.waited_s)
        return 0
    log.warning(
        "node %s still runs (%d Serve replica or proxy processes) after %.1fs",
        result.node_id,
        result.serving_left,
        result.waited_s,
    )
    return 1


_COMMANDS = {
    "generate": generate,
    "serve": _serve,
    "scale": _scale,
    "status": _status,
    "stop": _stop,
    "drain": _drain,
    "fetch": _fetch,
    "bench": bench_endpoint,
}


def _model_fetch_error() -> tuple[type[Exception], ...]:
    """workers.model's ModelFetchError, where a command imported it (`serve`, `generate
    --local`): only code that did can raise it, and importing it would load torch for the
    commands that only talk to a running service. (An `except` clause's tuple is evaluated
    when an exception is matched, after the command ran.)"""
    model = sys.modules.get("workers.model")
    return (model.ModelFetchError,) if model is not None else ()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    args = _build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, *_model_fetch_error(), ConnectionError, TimeoutError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.CalledProcessError) as e:
        # The service's failure, not the command line's (a deploy that failed, a
        # `ray start` that did not): said in one line, as the rest, with exit status 1.
        print(f"baton: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # the shell's code for an interrupt, without Python's traceback
    except Exception as e:
        # What Ray or Serve refused (a route prefix another application holds, a task
        # that failed remotely) is the service's answer; anything else is Baton's bug,
        # whose traceback is wanted.
        if not type(e).__module__.startswith("ray."):
            raise
        cause = getattr(e, "cause", None) or e  # a remote task's own error
        print(f"baton: error: {type(cause).__name__}: {cause}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
