"""ComfyUI's "unload models" unloads the backend's models too.

ComfyUI's page and API ask for it with ``POST /free`` (or ``/api/free``) and ``{"unload_models":
true}``; ``{"free_memory": true}`` unloads as well (ComfyUI's prompt worker treats it so). An
aiohttp middleware on ComfyUI's server observes that request, on ComfyUI's public HTTP route rather
than inside its code: ComfyUI answers first, then a daemon thread sends the backend at the nodes'
socket an ``unload``, so ComfyUI never waits on the backend. No backend answering means nothing to
do: one is never started for it.

Installed when ComfyUI loads the pack (``comfy_entrypoint``), before its server starts; ``uninstall``
takes it off again while the server has not started.
"""

from __future__ import annotations

import logging
import threading

from aiohttp import web  # ComfyUI's server library; this module is imported only when ComfyUI loads the pack

log = logging.getLogger("comfyui-xdit")

FREE_PATHS = ("/free", "/api/free")
UNLOAD_TIMEOUT_S = 600.0  # the unload waits for a generation already running; the thread gives up after this


def install_on_comfyui() -> bool:
    """Observe ``POST /free`` on ComfyUI's running server instance; False (and a log line) if there is none."""
    try:
        from server import PromptServer

        app = PromptServer.instance.app
    except (ImportError, AttributeError):
        log.warning("comfyui-xdit: ComfyUI's server was not found; its 'unload models' will not unload the "
                    "xDiT backend's (the xDiT Backend node's 'unload models' still does)")
        return False
    return install(app)


def install(app) -> bool:
    """Add the middleware to an aiohttp application that has not started; True if it was added now."""
    if observe_free in app.middlewares:
        return False
    if app.frozen:
        log.warning("comfyui-xdit: ComfyUI's server had already started; its 'unload models' will not unload the "
                    "xDiT backend's")
        return False
    app.middlewares.append(observe_free)
    return True


def uninstall(app) -> bool:
    """Take the middleware off an application that has not started; True if it was there."""
    if observe_free not in app.middlewares or app.frozen:
        return False
    app.middlewares.remove(observe_free)
    return True


@web.middleware
async def observe_free(request, handler):
    """aiohttp middleware: after ComfyUI has accepted a ``/free`` that unloads, unload the backend in a thread."""
    response = await handler(request)
    if request.method == "POST" and request.path in FREE_PATHS and response.status == 200:
        try:
            body = await request.json()  # aiohttp keeps the body ComfyUI's handler read
        except ValueError:
            return response
        if asks_unload(body):
            threading.Thread(target=unload_backend, name="xdit-free", daemon=True).start()
    return response


def asks_unload(body) -> bool:
    """Whether a ``/free`` body makes ComfyUI unload its models (``free_memory`` implies it, as in main.py)."""
    return isinstance(body, dict) and bool(body.get("unload_models") or body.get("free_memory"))


def unload_backend(socket_path=None) -> list[str] | None:
    """Unload every model of the backend at the nodes' socket; None when no backend answers there."""
    from xdit_backend.client import BackendError, Client
    from xdit_backend.wire.paths import default_socket

    client = Client(socket_path or default_socket())
    if client.hello_or_none() is None:
        return None
    try:
        unloaded = client.unload(timeout=UNLOAD_TIMEOUT_S)
    except (BackendError, OSError) as exc:
        log.warning("comfyui-xdit: ComfyUI unloaded its models, but the xDiT backend at %s did not: %s",
                    client.socket_path, exc)
        return None
    log.info("comfyui-xdit: ComfyUI unloaded its models; the xDiT backend unloaded %s",
             ", ".join(unloaded) or "nothing (none was loaded)")
    return unloaded
