"""Start, inspect, scale and stop a stack from any process on the machine (or cluster).

`up` starts the controller (which starts the members) on the Ray this process already
joined, on `address`, or on an embedded local Ray started here; an embedded stack gets a
random service token unless one is configured. It writes a small state file
(`$CHAINSPEC_STATE_DIR`, default `~/.chainspec`, one per namespace) with the Ray address,
so `status`, `scale` and `down` in another process join the same Ray.

A command acts only on a stack it can name (DESIGN 4.4): the explicit `address`, else the
namespace's state file -- never `$RAY_ADDRESS` or "auto" on its own. The address is
probed first with one short GCS call (Ray's own connect retries for minutes), and a
state file whose Ray is gone, or whose owner is dead and whose controller is gone, is
removed with a message.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray

from chainspec.cluster.config import CONTROLLER_NAME, NAMESPACE, StackConfig
from chainspec.cluster.controller import START_TIMEOUT_S, Controller
from chainspec.cluster.controller import _remove_group as remove_group
from chainspec.cluster.intent import IntentStore, actor_name
from chainspec.cluster.plain_target import serve_plainly

log = logging.getLogger(__name__)
HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node
STATE_ENV = "CHAINSPEC_STATE_DIR"
PROBE_TIMEOUT_S = 2.0  # asking a Ray address whether a cluster is there, before joining
GCS_PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
CALL_TIMEOUT_S = 10.0  # a controller query (members, config)
SHUTDOWN_TIMEOUT_S = 60.0
_joined: list[str] = []  # the address this process joined (for `Target`)


class StackError(RuntimeError):
    """A stack command that cannot proceed; the message says why."""


class StackNotFound(StackError):
    pass


class StackExists(StackError):
    pass


@dataclass(frozen=True)
class StackState:
    address: str  # Ray GCS address
    namespace: str
    owner_pid: int | None = None  # the process hosting an embedded Ray, if any


@dataclass(frozen=True)
class Target:
    """The stack a command acted on: what every command prints."""

    address: str
    namespace: str

    def __str__(self) -> str:
        return f"stack {self.namespace!r} on the Ray cluster at {self.address}"


def state_path(namespace: str = NAMESPACE) -> Path:
    base = Path(os.environ.get(STATE_ENV) or Path.home() / ".chainspec")
    return base / f"stack-{namespace}.json"


def read_state(namespace: str = NAMESPACE) -> StackState | None:
    try:
        return StackState(**json.loads(state_path(namespace).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def remove_state(namespace: str) -> None:
    state_path(namespace).unlink(missing_ok=True)
    state_path(namespace).with_suffix(".config.json").unlink(missing_ok=True)  # `up --detach`


def up(config: StackConfig, address: str | None = None,
       timeout_s: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
    """Start the controller and wait until every member is ready; returns the members.
    Without `address` and outside Ray, starts an embedded local Ray in this process; its
    stack gets a random service token unless `config` has one. A model without MTP
    modules starts no drafters (`plain_target`; `serve`/`up` say so first)."""
    config, warning = serve_plainly(config)
    if warning:
        log.warning("%s", warning)
    embedded = not ray.is_initialized() and address is None
    if embedded:
        check_no_local_owner(config.namespace)
        if config.auth_token is None:  # NOTE: no other local process may call its services
            config = dataclasses.replace(config, auth_token=secrets.token_urlsafe(32))
    if address is not None and not ray.is_initialized():
        address = _resolve(address)
        _probe(address)
    _init(address, config.namespace)
    if _find_controller(config.namespace) is not None:
        raise StackExists(f"a chainspec stack is already running in namespace "
                          f"{config.namespace!r}; use `chainspec scale` or `chainspec down`")
    # NOTE: on the head node when Ray says which it is (its metrics port is the head
    # pod's on Kubernetes, and the head outlives worker pods the autoscaler removes)
    head = {HEAD_RESOURCE: 0.001} if HEAD_RESOURCE in ray.cluster_resources() else {}
    controller = ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=config.namespace, lifetime="detached",
        max_restarts=-1, num_cpus=0, resources=head).remote(config, uuid.uuid4().hex)
    try:
        members = ray.get(controller.wait_ready.remote(timeout_s))
    except ray.exceptions.RayTaskError as e:  # a member failed to start, or timed out
        _stop(controller, config.namespace)
        raise StackError(f"the stack did not come up: {getattr(e, 'cause', e)}") from None
    except BaseException:
        _stop(controller, config.namespace)
        raise
    state = StackState(ray.get_runtime_context().gcs_address, config.namespace,
                       os.getpid() if embedded else None)
    path = state_path(config.namespace)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(state)))
    return members


def check_no_local_owner(namespace: str) -> None:
    """Refuse a second embedded stack while a live process hosts one in `namespace`."""
    state = read_state(namespace)
    if state is None or state.owner_pid in (None, os.getpid()):
        return
    if not _alive(state.owner_pid):
        return  # a stale state file
    raise StackExists(f"a chainspec stack in namespace {namespace!r} is hosted by process "
                      f"{state.owner_pid}; use `chainspec scale` or `chainspec down`")


def status(address: str | None = None, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    return _ask(connect(address, namespace).members.remote())


def config(address: str | None = None, namespace: str = NAMESPACE) -> StackConfig:
    """The running stack's configuration, token included (for its gateways)."""
    return StackConfig.from_dict(_ask(connect(address, namespace).get_config.remote()))


def _ask(ref):
    """A controller query, bounded: a restarting or stuck controller is an error."""
    try:
        return ray.get(ref, timeout=CALL_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise StackError(f"the controller did not answer within {CALL_TIMEOUT_S:.0f} s") \
            from None
    except ray.exceptions.ActorUnavailableError:
        raise StackError("the controller is restarting; try again in a moment") from None


def scale(role: str, n: int, address: str | None = None, namespace: str = NAMESPACE,
          wait: bool = True) -> list[dict[str, Any]]:
    try:
        return ray.get(connect(address, namespace).scale.remote(role, n, wait))
    except ray.exceptions.RayTaskError as e:  # a refused scale: say why, not the traceback
        if isinstance(e.cause, ValueError):
            raise StackError(str(e.cause)) from None
        raise
    except ray.exceptions.ActorUnavailableError:
        raise StackError(f"the controller restarted while scaling; it had recorded {n} "
                         f"{role}(s) first and carries on: see `chainspec status`") from None


def drain(member_ids: list[str], address: str | None = None, namespace: str = NAMESPACE
          ) -> list[dict[str, Any]]:
    """Drain these members and wait until they are gone (`Controller.drain_members`)."""
    try:
        return ray.get(connect(address, namespace).drain_members.remote(member_ids))
    except ray.exceptions.RayTaskError as e:  # an unknown member: say which
        if isinstance(e.cause, ValueError):
            raise StackError(str(e.cause)) from None
        raise
    except ray.exceptions.ActorUnavailableError:
        raise StackError("the controller restarted while draining; it had recorded the "
                         "drain first and carries on: see `chainspec status`") from None


def autoscale_state(address: str | None = None, namespace: str = NAMESPACE
                    ) -> dict[str, Any]:
    """The drafter autoscaling policy (None: fixed), last decision, desired count and the
    latest signals (`Controller.autoscale_state`)."""
    return _ask(connect(address, namespace).autoscale_state.remote())


def set_autoscale(policy: dict[str, Any] | None, address: str | None = None,
                  namespace: str = NAMESPACE) -> dict[str, Any]:
    """Autoscale the drafters under `policy` (AutoscalePolicy fields), or stop (None)."""
    try:
        return _ask(connect(address, namespace).set_autoscale.remote(policy))
    except ray.exceptions.RayTaskError as e:  # a refused policy: say why
        if isinstance(e.cause, ValueError):
            raise StackError(str(e.cause)) from None
        raise


def down(address: str | None = None, namespace: str = NAMESPACE) -> None:
    """Stop every member and the controller; stop the embedded Ray's owner process. With
    the controller gone for good, members its intent still lists are killed by name."""
    try:
        controller = connect(address, namespace)
    except StackNotFound:
        if not ray.is_initialized() or not _kill_orphans(namespace):
            raise
    else:
        _stop(controller, namespace)
    state = read_state(namespace)
    remove_state(namespace)
    if state is not None and state.owner_pid not in (None, os.getpid()):
        try:
            os.kill(state.owner_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def connect(address: str | None = None, namespace: str = NAMESPACE):
    """The controller of a running stack, joining its Ray if this process has not: the
    explicit `address`, else the namespace's state file; nothing else."""
    state = None
    if not ray.is_initialized():
        state = None if address is not None else read_state(namespace)
        if address is None and state is None:
            raise StackNotFound(
                f"no stack named: there is no state file {state_path(namespace)} for "
                f"namespace {namespace!r}; pass --address (the stack's Ray address, or "
                f"`auto` for the local one) and --namespace")
        target = _resolve(address or state.address)
        try:
            _probe(target)
        except StackNotFound as e:
            raise _stale(state, namespace, str(e)) from None
        _init(target, namespace)
    controller = _find_controller(namespace)
    if controller is None:
        gone = f"no chainspec stack in namespace {namespace!r} of the Ray cluster at " \
               f"{target_of(namespace).address}"
        if state is not None and not (state.owner_pid and _alive(state.owner_pid)):
            raise _stale(state, namespace, gone)
        raise StackNotFound(gone)
    return controller


def target_of(namespace: str) -> Target:
    """The Ray this process joined and `namespace`: the stack a command acts on."""
    if _joined:
        return Target(_joined[-1], namespace)
    try:
        return Target(ray.get_runtime_context().gcs_address, namespace)
    except Exception:  # Ray Client, or not joined
        return Target("this process's Ray", namespace)


def _stale(state: StackState | None, namespace: str, why: str) -> StackNotFound:
    if state is None:
        return StackNotFound(why)
    remove_state(namespace)
    return StackNotFound(f"{why}; removed the stale state file {state_path(namespace)}")


def _resolve(address: str) -> str:
    """An explicit "auto" to the local Ray's GCS address (an explicit choice)."""
    if address != "auto":
        return address
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        return canonicalize_bootstrap_address_or_die("auto")
    except ConnectionError as e:
        raise StackNotFound(f"--address auto: {e}") from None


def _probe(address: str) -> None:
    """Ask the address, within PROBE_TIMEOUT_S, whether a Ray cluster is there: Ray's own
    connect retries for minutes against a dead address, and hangs on one where something
    else listens."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise StackNotFound(f"bad Ray address {address!r}: expected HOST:PORT")
    if address.startswith("ray://"):  # the Ray Client server: a plain TCP connect
        try:
            socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT_S).close()
        except OSError as e:
            raise StackNotFound(f"no Ray cluster answers at {address} ({e.strerror or e})") \
                from None
        return
    _probe_gcs(address)


def _probe_gcs(address: str) -> None:
    """One GCS call (Ray 2.60's NodeInfoGcsService.GetClusterId, an empty request)."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(GCS_PROBE_METHOD)(b"", timeout=PROBE_TIMEOUT_S)
            return
        except grpc.RpcError as e:
            code = e.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        raise StackNotFound(f"no Ray cluster answers at {address} ({code.name})")
    if code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        raise StackNotFound(f"{address} answers, but not as a Ray cluster ({code.name})")


def _init(address: str | None, namespace: str) -> None:
    if ray.is_initialized():
        return
    if address is None:  # embedded: a local Ray owned by this process
        ray.init(namespace=namespace, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, namespace=namespace, logging_level=logging.ERROR,
                 log_to_driver=False)
        _joined.append(address)


def _find_controller(namespace: str):
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        return None


def _stop(controller, namespace: str) -> None:
    """Shut the members down, kill the controller for good, forget the intent."""
    try:
        ray.get(controller.shutdown.remote(), timeout=SHUTDOWN_TIMEOUT_S)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass  # stopped meanwhile, or stuck: what it left is killed by name below
    finally:
        ray.kill(controller, no_restart=True)
    _kill_orphans(namespace)


def _kill_orphans(namespace: str) -> int:
    """Members of a stack whose controller is gone for good, by the names its intent
    lists; the number killed."""
    store = IntentStore(namespace)
    intent = store.load()
    if intent is None:
        return 0
    killed = 0
    for member_id in intent.members:
        try:
            ray.kill(ray.get_actor(actor_name(member_id), namespace=namespace),
                     no_restart=True)
            killed += 1
        except ValueError:
            pass
        remove_group(member_id)  # a TP verifier's placement group
    store.clear()
    return killed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
