"""Start, inspect, scale and stop a stack from any process on the machine (or cluster).

`up` starts the controller (which starts the members) on the Ray this process already
joined, on `address`, or on an embedded local Ray started here. It writes a small state
file (`$CHAINSPEC_STATE_DIR`, default `~/.chainspec`, one per namespace) with the Ray
address, so `status`, `scale` and `down` in another process join the same Ray: address
resolution is explicit `address` > state file > `RAY_ADDRESS` > "auto".
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray

from chainspec.cluster.config import CONTROLLER_NAME, NAMESPACE, StackConfig
from chainspec.cluster.controller import START_TIMEOUT_S, Controller

STATE_ENV = "CHAINSPEC_STATE_DIR"


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


def state_path(namespace: str = NAMESPACE) -> Path:
    base = Path(os.environ.get(STATE_ENV) or Path.home() / ".chainspec")
    return base / f"stack-{namespace}.json"


def read_state(namespace: str = NAMESPACE) -> StackState | None:
    try:
        return StackState(**json.loads(state_path(namespace).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def up(config: StackConfig, address: str | None = None,
       timeout_s: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
    """Start the controller and wait until every member is ready; returns the members.
    Without `address` and outside Ray, starts an embedded local Ray in this process."""
    embedded = not ray.is_initialized() and address is None
    if embedded:
        check_no_local_owner(config.namespace)
    _init(address, config.namespace)
    if _find_controller(config.namespace) is not None:
        raise StackExists(f"a chainspec stack is already running in namespace "
                          f"{config.namespace!r}; use `chainspec scale` or `chainspec down`")
    controller = ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=config.namespace, lifetime="detached",
        max_restarts=-1, num_cpus=0).remote(config)
    try:
        members = ray.get(controller.wait_ready.remote(timeout_s))
    except ray.exceptions.RayTaskError as e:  # a member failed to start, or timed out
        _stop(controller)
        raise StackError(f"the stack did not come up: {getattr(e, 'cause', e)}") from None
    except BaseException:
        _stop(controller)
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
    try:
        os.kill(state.owner_pid, 0)
    except ProcessLookupError:
        return  # a stale state file
    raise StackExists(f"a chainspec stack in namespace {namespace!r} is hosted by process "
                      f"{state.owner_pid}; use `chainspec scale` or `chainspec down`")


def status(address: str | None = None, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    return ray.get(connect(address, namespace).members.remote())


def scale(role: str, n: int, address: str | None = None, namespace: str = NAMESPACE,
          wait: bool = True) -> list[dict[str, Any]]:
    return ray.get(connect(address, namespace).scale.remote(role, n, wait))


def down(address: str | None = None, namespace: str = NAMESPACE) -> None:
    """Stop every member and the controller; stop the embedded Ray's owner process."""
    _stop(connect(address, namespace))
    state = read_state(namespace)
    state_path(namespace).unlink(missing_ok=True)
    state_path(namespace).with_suffix(".config.json").unlink(missing_ok=True)  # `up --detach`
    if state is not None and state.owner_pid not in (None, os.getpid()):
        try:
            os.kill(state.owner_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def connect(address: str | None = None, namespace: str = NAMESPACE):
    """The controller of a running stack (joining its Ray if this process has not)."""
    if not ray.is_initialized():
        state = read_state(namespace)
        address = address or (state.address if state else None) \
            or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        _init(address, namespace)
    except ConnectionError as e:
        raise StackNotFound(f"no Ray cluster at {address}: {e}") from None
    controller = _find_controller(namespace)
    if controller is None:
        raise StackNotFound(f"no chainspec stack in namespace {namespace!r} of the Ray "
                            f"cluster at {ray.get_runtime_context().gcs_address}")
    return controller


def _init(address: str | None, namespace: str) -> None:
    if ray.is_initialized():
        return
    if address is None:  # embedded: a local Ray owned by this process
        ray.init(namespace=namespace, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, namespace=namespace, logging_level=logging.ERROR,
                 log_to_driver=False)


def _find_controller(namespace: str):
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        return None


def _stop(controller) -> None:
    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        return  # stopped meanwhile (a `down` from another process)
    finally:
        ray.kill(controller, no_restart=True)
