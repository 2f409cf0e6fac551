"""ComfyUI's "unload models" (POST /free) reaches the backend: which bodies ask for it, the
middleware on an aiohttp server answering the way ComfyUI's does, and never starting a backend.
The same in the real ComfyUI: tests/host/test_comfyui_host.py."""

import asyncio
import threading

import pytest
from conftest import load_node_module, short_socket_dir

web = pytest.importorskip("aiohttp.web")
test_utils = pytest.importorskip("aiohttp.test_utils")


free_hook = load_node_module("free_hook")


def test_the_bodies_that_make_comfyui_unload():
    assert free_hook.asks_unload({"unload_models": True})
    assert free_hook.asks_unload({"unload_models": True, "free_memory": True})  # the page's "free cache" button
    assert free_hook.asks_unload({"free_memory": True})  # ComfyUI's worker unloads for it too
    assert not free_hook.asks_unload({"unload_models": False})
    assert not free_hook.asks_unload({})
    assert not free_hook.asks_unload(["unload_models"])


def test_install_is_once_and_reversible_before_the_server_starts():
    app = web.Application()
    assert free_hook.install(app) and not free_hook.install(app)
    assert list(app.middlewares).count(free_hook.observe_free) == 1
    assert free_hook.uninstall(app) and free_hook.observe_free not in app.middlewares
    app.freeze()
    assert not free_hook.install(app), "a started server's middlewares cannot change"


def post_free_to_a_comfyui_like_server(monkeypatch, requests: list[tuple[str, str, dict | None]]) -> int:
    """Serve a ComfyUI-like /free (it reads the JSON body) with the hook installed; send ``requests``;
    return how many unloads the hook started."""
    unloads = threading.Semaphore(0)
    started = []
    monkeypatch.setattr(free_hook, "unload_backend", lambda: (started.append(1), unloads.release()))

    async def post_free(request):
        await request.json()
        return web.Response(status=200)

    async def ok(request):
        return web.Response(status=200)

    async def run():
        app = web.Application()
        app.router.add_post("/free", post_free)
        app.router.add_post("/api/free", post_free)
        app.router.add_get("/free", ok)
        free_hook.install(app)
        async with test_utils.TestClient(test_utils.TestServer(app)) as client:
            for method, path, body in requests:
                response = await client.request(method, path, json=body)
                assert response.status == 200

    asyncio.run(run())
    for _ in range(10):  # the threads the hook started, each released once
        if not unloads.acquire(timeout=0.2):
            break
    return len(started)


def test_post_free_with_unload_models_starts_one_unload_per_request(monkeypatch):
    assert post_free_to_a_comfyui_like_server(monkeypatch, [("POST", "/free", {"unload_models": True}),
                                                            ("POST", "/api/free", {"free_memory": True})]) == 2


def test_other_requests_start_no_unload(monkeypatch):
    assert post_free_to_a_comfyui_like_server(monkeypatch, [("POST", "/free", {"unload_models": False}),
                                                            ("POST", "/free", {}),
                                                            ("GET", "/free", None)]) == 0


def test_with_no_backend_running_none_is_started():
    sock = short_socket_dir() / "backend.sock"
    assert free_hook.unload_backend(sock) is None
    assert sorted(p.name for p in sock.parent.iterdir()) == []
