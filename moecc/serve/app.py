"""The HTTP side: OpenAI's Files and Batches endpoints, `/v1/models` and the status page.

Needs: the store, blobs, served models, the runner and the auth. Does: answers every route
with OpenAI's object shapes and status codes (errors in OpenAI's error shape, also for
unknown routes and bad JSON); the database calls run in Starlette's thread pool and
uploads stream to disk, so the event loop stays free. Guarantees: an object is found
only by its owner (another key gets 404); ids in paths are checked against the server's
own id format before anything else; no client string is ever used as a path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from moecc.serve import status, uploads
from moecc.serve.auth import Auth
from moecc.serve.blobs import Blobs
from moecc.serve.config import ServeConfig
from moecc.serve.errors import APIError, not_found
from moecc.serve.plans import ServedModel
from moecc.serve.runner import Runner
from moecc.serve.store import ACTIVE, Store, batch_object, file_object, new_id, now

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOW_S = {"24h": 24 * 3600}
_FILE_ID = re.compile(r"^file-[A-Za-z0-9]{24}$")
_BATCH_ID = re.compile(r"^batch_[A-Za-z0-9]{24}$")
_JSON_LIMIT = 1 << 20  # bytes of a JSON request body
COOKIE = "moecc_key"


@dataclass
class Server:
    """What the routes share."""

    cfg: ServeConfig
    store: Store
    blobs: Blobs
    models: dict[str, ServedModel]
    runner: Runner
    auth: Auth

    def owner(self, request: Request) -> str:
        return self.auth.owner(request.headers.get("authorization"))


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise APIError(400, f"'{name}' must be an integer from {lo} to {hi}, got {raw!r}", param=name,
                       code="invalid_value")
    return value


async def _json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; 400 in OpenAI's shape when it is not one (or too large)."""
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > _JSON_LIMIT:
            raise APIError(413, f"the JSON body is larger than {_JSON_LIMIT} bytes", code="request_too_large")
    try:
        body = json.loads(bytes(data))
    except (ValueError, RecursionError):
        raise APIError(400, "We could not parse the JSON body of your request. (HINT: This likely means you "
                            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, but "
                            "what was sent was not valid JSON.)", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the JSON body must be an object", code="invalid_json")
    return body


def _file_row(s: Server, request: Request) -> dict[str, Any]:
    fid = request.path_params["file_id"]
    row = s.store.file(s.owner(request), fid) if _FILE_ID.match(fid) else None
    if row is None:
        raise not_found("File", fid)
    return row


def _batch_row(s: Server, request: Request) -> dict[str, Any]:
    bid = request.path_params["batch_id"]
    row = s.store.batch(bid, s.owner(request)) if _BATCH_ID.match(bid) else None
    if row is None:
        raise not_found("Batch", bid)
    return row


def _page(rows: list[dict[str, Any]], more: bool, shape: Callable[[dict[str, Any]], dict[str, Any]]) -> JSONResponse:
    data = [shape(r) for r in rows]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": more})


# -- models ---------------------------------------------------------------------------------
def list_models(s: Server, request: Request) -> JSONResponse:
    s.owner(request)
    return JSONResponse({"object": "list", "data": [_model(m) for m in s.models.values()]})


def get_model(s: Server, request: Request) -> JSONResponse:
    s.owner(request)
    m = s.models.get(request.path_params["model"])
    if m is None:
        raise APIError(404, f"The model `{request.path_params['model']}` does not exist", param="model",
                       code="model_not_found")
    return JSONResponse(_model(m))


def _model(m: ServedModel) -> dict[str, Any]:
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "moecc"}


# -- files ----------------------------------------------------------------------------------
async def create_file(s: Server, request: Request) -> JSONResponse:
    owner = s.owner(request)
    up = await uploads.receive(request, s.blobs, s.cfg.max_file_size)
    try:
        purpose = up.fields.get("purpose")
        if purpose != "batch":
            raise APIError(400, f"'purpose' must be 'batch' on this server (got {purpose!r}): it stores batch "
                                f"input files", param="purpose", code="invalid_value")
        fid = new_id("file-")
        row = {"id": fid, "owner": owner, "bytes": up.size, "created_at": now(),
               "filename": (up.filename or "upload.jsonl")[:255], "purpose": purpose, "blob": fid}
        assert up.tmp is not None
        await run_in_threadpool(s.blobs.commit, up.tmp, fid)
        up.tmp = None
        await run_in_threadpool(s.store.add_file, row)
    finally:
        up.discard()
    return JSONResponse(file_object(row))


def list_files(s: Server, request: Request) -> JSONResponse:
    owner = s.owner(request)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"'order' must be 'asc' or 'desc', got {order!r}", param="order", code="invalid_value")
    rows, more = s.store.files(owner, purpose=request.query_params.get("purpose"),
                               after=request.query_params.get("after"),
                               limit=_int_param(request, "limit", 10000, 1, 10000), order=order)
    return _page(rows, more, file_object)


def get_file(s: Server, request: Request) -> JSONResponse:
    return JSONResponse(file_object(_file_row(s, request)))


def file_content(s: Server, request: Request) -> Response:
    row = _file_row(s, request)
    return FileResponse(s.blobs.path(row["blob"]), media_type="application/octet-stream")


def delete_file(s: Server, request: Request) -> JSONResponse:
    row = _file_row(s, request)
    if s.store.delete_file(row["owner"], row["id"]) is None:
        raise not_found("File", row["id"])
    s.blobs.remove(row["blob"])
    return JSONResponse({"id": row["id"], "object": "file", "deleted": True})


# -- batches --------------------------------------------------------------------------------
def _check_metadata(meta: Any) -> dict[str, str] | None:
    if meta is None:
        return None
    if not isinstance(meta, dict) or len(meta) > 16:
        raise APIError(400, "'metadata' must be an object of at most 16 string pairs", param="metadata",
                       code="invalid_value")
    for k, v in meta.items():
        if not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise APIError(400, f"metadata[{k[:64]!r}]: keys are strings of at most 64 characters, values strings "
                                f"of at most 512", param="metadata", code="invalid_value")
    return meta


async def create_batch(s: Server, request: Request) -> JSONResponse:
    owner = s.owner(request)
    body = await _json_body(request)
    return await run_in_threadpool(_create_batch, s, owner, body)


def _create_batch(s: Server, owner: str, body: dict[str, Any]) -> JSONResponse:
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise APIError(400, f"Missing required parameter: '{name}' (a string).", param=name,
                           code="missing_required_parameter")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                  "output_expires_after"})
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unknown_parameter")
    if body["endpoint"] not in ENDPOINTS:
        raise APIError(400, f"Invalid value for 'endpoint': {body['endpoint']!r}; this server runs "
                            f"{', '.join(ENDPOINTS)}", param="endpoint", code="invalid_value")
    if body["completion_window"] not in WINDOW_S:
        raise APIError(400, f"Invalid value for 'completion_window': {body['completion_window']!r}; supported: "
                            f"'24h'", param="completion_window", code="invalid_value")
    meta = _check_metadata(body.get("metadata"))
    fid = body["input_file_id"]
    f = s.store.file(owner, fid) if _FILE_ID.match(fid) else None
    if f is None:
        raise not_found("File", fid, param="input_file_id")
    if f["purpose"] != "batch":
        raise APIError(400, f"file {fid} has purpose {f['purpose']!r}; a batch's input file must have purpose "
                            f"'batch'", param="input_file_id", code="invalid_value")
    t = now()
    row = {"id": new_id("batch_"), "owner": owner, "endpoint": body["endpoint"], "input_file_id": fid,
           "completion_window": body["completion_window"], "status": "validating",
           "metadata": json.dumps(meta) if meta is not None else None, "created_at": t,
           "expires_at": t + WINDOW_S[body["completion_window"]]}
    if not s.store.add_batch(row, owner, s.cfg.max_active_batches):
        raise APIError(429, f"this key has {s.cfg.max_active_batches} batches not yet finished; wait for some to "
                            f"finish (or cancel them) before creating more", code="batch_limit_exceeded")
    s.runner.wake.set()
    return JSONResponse(batch_object(s.store.batch(row["id"])))  # type: ignore[arg-type]


def get_batch(s: Server, request: Request) -> JSONResponse:
    return JSONResponse(batch_object(_batch_row(s, request)))


def list_batches(s: Server, request: Request) -> JSONResponse:
    owner = s.owner(request)
    rows, more = s.store.batches(owner, after=request.query_params.get("after"),
                                 limit=_int_param(request, "limit", 20, 1, 100))
    return _page(rows, more, batch_object)


def cancel_batch(s: Server, request: Request) -> JSONResponse:
    row = _batch_row(s, request)
    if row["status"] in ("validating", "in_progress"):
        if s.store.transition(row["id"], ("validating", "in_progress"), "cancelling", cancelling_at=now()):
            s.runner.wake.set()
        row = s.store.batch(row["id"]) or row
    if row["status"] not in ("cancelling", "cancelled"):
        raise APIError(409, f"Cannot cancel a batch with status '{row['status']}'.", param="batch_id",
                       code="invalid_state")
    return JSONResponse(batch_object(row))


# -- the status page ------------------------------------------------------------------------
def status_page(s: Server, request: Request) -> Response:
    key = request.query_params.get("key")
    if key is not None:  # a browser cannot send Bearer: the key goes into a cookie, out of the URL
        s.auth.owner(None, key)
        resp = RedirectResponse("/", status_code=303)
        resp.set_cookie(COOKIE, key, httponly=True, samesite="strict")
        return resp
    try:
        owner = s.auth.owner(request.headers.get("authorization"), request.cookies.get(COOKIE))
    except APIError as e:
        return HTMLResponse(status.login_page(str(e)), status_code=401)
    rows, _ = s.store.batches(owner, after=None, limit=50)
    return HTMLResponse(status.render(rows, s.runner.live, s.models, ACTIVE))


def make_app(s: Server) -> Starlette:
    """The Starlette application of `s` (routes bound to it, errors in OpenAI's shape)."""
    def bind(fn: Callable[..., Any]) -> Callable[[Request], Any]:
        if _is_async(fn):
            async def async_route(request: Request) -> Any:
                return await fn(s, request)
            return async_route

        def route(request: Request) -> Any:  # sync: Starlette runs it in its thread pool
            return fn(s, request)
        return route

    routes = [Route("/", bind(status_page), methods=["GET"]),
              Route("/v1/models", bind(list_models), methods=["GET"]),
              Route("/v1/models/{model}", bind(get_model), methods=["GET"]),
              Route("/v1/files", bind(create_file), methods=["POST"]),
              Route("/v1/files", bind(list_files), methods=["GET"]),
              Route("/v1/files/{file_id}", bind(get_file), methods=["GET"]),
              Route("/v1/files/{file_id}", bind(delete_file), methods=["DELETE"]),
              Route("/v1/files/{file_id}/content", bind(file_content), methods=["GET"]),
              Route("/v1/batches", bind(create_batch), methods=["POST"]),
              Route("/v1/batches", bind(list_batches), methods=["GET"]),
              Route("/v1/batches/{batch_id}", bind(get_batch), methods=["GET"]),
              Route("/v1/batches/{batch_id}/cancel", bind(cancel_batch), methods=["POST"])]

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return APIError(404, f"Invalid URL ({request.method} {request.url.path})", code="unknown_url").response()
        return APIError(exc.status_code, f"{request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed").response()

    async def server_error(request: Request, exc: Exception) -> Response:
        return APIError(500, f"The server had an error while processing your request: {type(exc).__name__}",
                        code="server_error").response()

    return Starlette(routes=routes, exception_handlers={APIError: api_error, HTTPException: http_error,
                                                        Exception: server_error})


def _is_async(fn: Callable[..., Any]) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)
