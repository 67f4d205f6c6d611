#!/usr/bin/env python3
"""An emulator of the Azure Resource Manager (ARM) calls Egret's Azure provider
makes, for its tests: finding public IP addresses by tag, reading a virtual
machine, its network interfaces and their subnet, and moving public IPs and
private IP configurations between network interfaces with NIC PUTs.

What it emulates and where it differs from the real service is in README.md;
model.py holds the resources and the rules a NIC update must pass. Beside the
ARM calls it serves a control API under /_emulator/ (seeding, faults, delays,
the request log and where every address is routed now).

Run: emulator.py [--address 127.0.0.1] [--port 0] [--port-file F] [--tls-dir D]
(azure-emulator.sh runs it so; D holds server.pem and server.key).
"""

from __future__ import annotations

import argparse
import base64
import copy
import fnmatch
import json
import math
import os
import re
import ssl
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

import model
from model import COMPUTE_API, NETWORK_API, NIC, PUBLIC_IP, RESOURCES_API, VM, ArmError, Nic, World, key

# Settings the control API can change (PUT /_emulator/config), with defaults.
DEFAULTS: dict[str, object] = {
    "asyncDelay": 0.2,  # seconds from an accepted NIC PUT to its commit
    "retryAfter": 1,  # Retry-After (s) on accepted PUTs and running operations
    "staleness": 0.0,  # seconds by which public IP and NIC reads lag commits
    "pageSize": 100,  # items per page of a list
    "readBucket": 250,  # ARM's token buckets per subscription and principal
    "readRefill": 25.0,
    "writeBucket": 200,
    "writeRefill": 10.0,
    "tokens": [],  # accepted bearer tokens; empty accepts any
    # ARM accepts only the tokens the emulated Entra ID token endpoint issued
    # (and those in `tokens`); README.md, "Entra ID's token endpoint".
    "requireIssuedTokens": False,
}

# The token endpoint's path (Microsoft identity platform, "client
# credentials flow": POST /{tenant}/oauth2/v2.0/token).
TOKEN_PATH = re.compile(r"/(?P<tenant>[^/]+)/oauth2/v2\.0/token")
# What a federated credential's request carries (same page, "Third case:
# Access token request with a federated credential").
ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
TOKEN_TTL = 3599

API_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}(-preview)?$")


@dataclass
class Request:
    method: str
    path: str  # percent-decoded
    raw_path: str  # as sent, for nextLinks
    query: dict[str, str]
    headers: dict[str, str]
    raw: bytes
    base: str  # scheme://host:port
    now: float = 0.0
    params: dict[str, str] = field(default_factory=dict)
    ratelimit: tuple[str, int] | None = None  # the remaining-requests header

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers.items() if k.lower() == name.lower()), None)

    def json(self) -> object:
        try:
            return json.loads(self.raw or b"null")
        except ValueError as e:
            raise ArmError(
                400, "InvalidRequestContent", f"The request content was invalid and could not be deserialized: {e}"
            ) from None

    def logged_body(self) -> object:
        if not self.raw:
            return None
        try:
            return json.loads(self.raw)
        except ValueError:
            return self.raw.decode("utf-8", "replace")


@dataclass
class Response:
    status: int
    body: object = None
    headers: dict[str, str] = field(default_factory=dict)


def error_response(e: ArmError) -> Response:
    return Response(e.status, e.body(), dict(e.headers))


@dataclass
class Fault:
    """A failure armed on requests whose method and path match (README.md, "Faults")."""

    id: int
    method: str
    path: str  # a shell glob, compared without case
    times: int
    status: int | None = None
    code: str = ""
    message: str = ""
    retry_after: int | None = None
    stall: float = 0.0
    async_error: dict | None = None

    def matches(self, req: Request) -> bool:
        return self.method in ("*", req.method) and fnmatch.fnmatchcase(req.path.lower(), self.path.lower())

    def describe(self) -> dict:
        out = {"id": self.id, "method": self.method, "path": self.path, "times": self.times}
        if self.status is not None:
            out.update(status=self.status, code=self.code, message=self.message, retryAfter=self.retry_after)
        if self.stall:
            out["stall"] = self.stall
        if self.async_error:
            out["asyncError"] = self.async_error
        return out


def parse_fault(spec: object, fault_id: int) -> Fault:
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
        raise control_error("a fault needs a 'path' glob")
    kinds = [k for k in ("status", "stall", "asyncError") if k in spec]
    if len(kinds) != 1:
        raise control_error("a fault has exactly one of 'status', 'stall', 'asyncError'")
    fault = Fault(
        id=fault_id,
        method=str(spec.get("method", "*")).upper(),
        path=spec["path"],
        times=int(spec.get("times", 1)),
    )
    if fault.times < 1:
        raise control_error("'times' must be at least 1")
    if "status" in spec:
        fault.status = int(spec["status"])
        fault.code = str(spec.get("code", "InternalServerError"))
        fault.message = str(spec.get("message", "Injected by the emulator's control API."))
        fault.retry_after = int(spec["retryAfter"]) if "retryAfter" in spec else None
    elif "stall" in spec:
        fault.stall = float(spec["stall"])
    else:
        error = spec["asyncError"]
        if fault.method != "PUT" or not isinstance(error, dict) or "code" not in error:
            raise control_error("'asyncError' is {code, message} on method PUT (a NIC update that then fails)")
        fault.async_error = {"code": str(error["code"]), "message": str(error.get("message", "Injected failure."))}
    return fault


def control_error(message: str) -> ArmError:
    return ArmError(400, "InvalidControlRequest", message)


class Bucket:
    """ARM's token bucket: `size` tokens, refilled at `refill` per second."""

    def __init__(self, size: int, refill: float, now: float):
        self.size = size
        self.refill = refill
        self.tokens = float(size)
        self.at = now

    def take(self, now: float) -> float:
        """Takes a token: 0 when granted, otherwise the seconds until one is there."""
        self.tokens = min(self.size, self.tokens + (now - self.at) * self.refill)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.refill


@dataclass
class Operation:
    """A NIC PUT's long-running operation."""

    id: str
    nic: Nic  # the NIC as it will be once committed
    created: bool  # the PUT made the NIC
    due: float
    error: dict | None  # set: the operation fails with it
    status: str = "InProgress"


@dataclass
class Route:
    method: str
    pattern: re.Pattern
    api: str
    rtype: str | None  # the provider's resource type; None for ARM's own calls
    handler: Callable[[Emulator, Request, dict | None], Response]


NETWORK_PROVIDER = "/providers/Microsoft.Network"
SUB = r"/subscriptions/(?P<sub>[^/]+)"
RG = SUB + r"/resourceGroups/(?P<rg>[^/]+)"
NET = re.escape(NETWORK_PROVIDER)
NAME = r"/(?P<name>[^/]+)"


class Emulator:
    """The emulator's state and behaviour; `Server` puts HTTP in front of it.
    Every entry point takes the lock; a stall sleeps without it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epoch = time.monotonic()
        self.reset()

    def reset(self) -> None:
        self.config = copy.deepcopy(DEFAULTS)
        self.world = World()
        # (commit time, World): what a stale read sees; oldest first.
        self.history: list[tuple[float, World]] = [(-math.inf, World())]
        self.ops: dict[str, Operation] = {}
        self.buckets: dict[tuple[str, str, str], Bucket] = {}
        self.faults: list[Fault] = []
        self.next_fault = 1
        self.log: list[dict] = []
        self.issued: set[str] = set()
        self.token_log: list[dict] = []

    # ------------------------------------------------------------ time ---

    def _commit(self, at: float) -> None:
        self.history.append((at, copy.deepcopy(self.world)))
        horizon = time.monotonic() - float(self.config["staleness"])
        while len(self.history) > 1 and self.history[1][0] <= horizon:
            self.history.pop(0)

    def _view(self, now: float, stale: bool) -> World:
        """The world a read sees: the committed one, or as it was `staleness` ago."""
        if not stale or not self.config["staleness"]:
            return self.world
        horizon = now - float(self.config["staleness"])
        return next((w for t, w in reversed(self.history) if t <= horizon), self.history[0][1])

    def _advance(self, now: float) -> None:
        """Completes every operation due by `now`, in order, each at its due time."""
        for op in sorted((o for o in self.ops.values() if o.status == "InProgress"), key=lambda o: o.due):
            if op.due > now:
                break
            current = self.world.nics.get(key(op.nic.id))
            if op.error:
                op.status = "Failed"
                if current:
                    current.state = "Failed"
            else:
                op.status = "Succeeded"
                before = {p.id: self.world.association(p.id) for p in self.world.public_ips.values()}
                self.world.nics[key(op.nic.id)] = op.nic
                for pip in self.world.public_ips.values():
                    if _assoc_ids(self.world.association(pip.id)) != _assoc_ids(before[pip.id]):
                        pip.etag = model.new_etag()
            self._commit(op.due)

    def _pending(self) -> list[Nic]:
        return [o.nic for o in self.ops.values() if o.status == "InProgress"]

    # ------------------------------------------------------------- ARM ---

    def arm(self, req: Request) -> Response:
        """One ARM call: authentication, api-version, throttling, faults, then the call."""
        with self.lock:
            req.now = time.monotonic()
            self._advance(req.now)
            try:
                route = self._front(req)
                fault = self._take_fault(req)
            except ArmError as e:
                return self._logged(req, error_response(e))
        if fault and fault.stall:
            time.sleep(fault.stall)
        with self.lock:
            req.now = time.monotonic()
            self._advance(req.now)
            try:
                resp = route.handler(self, req, fault.async_error if fault else None)
            except ArmError as e:
                resp = error_response(e)
            return self._logged(req, resp)

    def _logged(self, req: Request, resp: Response) -> Response:
        if req.ratelimit:
            header, remaining = req.ratelimit
            resp.headers.setdefault(header, str(remaining))
        resp.headers.setdefault("x-ms-request-id", str(uuid.uuid4()))
        correlation = req.header("x-ms-correlation-request-id") or str(uuid.uuid4())
        resp.headers.setdefault("x-ms-correlation-request-id", correlation)
        headers = {k: v for k, v in req.headers.items() if k.lower() != "authorization"}
        if req.header("Authorization") is not None:
            headers["Authorization"] = "<redacted>"
        self.log.append(
            {
                "seq": len(self.log) + 1,
                "time": round(req.now - self.epoch, 6),
                "method": req.method,
                "path": req.path,
                "query": dict(req.query),
                "headers": headers,
                "body": req.logged_body(),
                "status": resp.status,
                "error": resp.body["error"].get("code") if isinstance(resp.body, dict) and isinstance(resp.body.get("error"), dict) else None,
            }
        )
        return resp

    def _front(self, req: Request) -> Route:
        principal = self._authenticate(req.header("Authorization"))
        candidates = [(r, r.pattern.fullmatch(req.path)) for r in ROUTES]
        candidates = [(r, m) for r, m in candidates if m]
        route, match = next(((r, m) for r, m in candidates if r.method == req.method), (None, None))
        if route is None:
            if candidates:
                raise ArmError(405, "MethodNotAllowed", f"The emulator does not serve {req.method} on {req.path}.")
            raise ArmError(404, "NotFound", f"The emulator does not serve {req.method} {req.path} (see its README.md).")
        req.params = match.groupdict()
        self._check_api_version(req, route)
        kind = "reads" if req.method == "GET" else "writes"
        sub = req.params["sub"].lower()
        bucket = self.buckets.get((sub, principal, kind))
        if bucket is None:
            prefix = kind.removesuffix("s")
            bucket = Bucket(int(self.config[f"{prefix}Bucket"]), float(self.config[f"{prefix}Refill"]), req.now)
            self.buckets[(sub, principal, kind)] = bucket
        wait = bucket.take(req.now)
        header = f"x-ms-ratelimit-remaining-subscription-{kind}"
        req.ratelimit = (header, int(bucket.tokens))
        if wait:
            seconds = math.ceil(wait)
            raise ArmError(
                429,
                "SubscriptionRequestsThrottled",
                f"Number of '{kind.removesuffix('s')}' requests for subscription '{req.params['sub']}' "
                f"actor '{principal}' exceeded. Please try again after '{seconds}' seconds after additional "
                "tokens are available. Refer to https://aka.ms/arm-throttling for additional information.",
                {"Retry-After": str(seconds)},
            )
        return route

    def _authenticate(self, auth: str | None) -> str:
        """The principal a bearer token stands for (the token itself)."""
        challenge = 'Bearer authorization_uri="https://login.microsoftonline.com/common", error="invalid_token"'
        if auth is None:
            raise ArmError(
                401,
                "AuthenticationFailed",
                "Authentication failed. The 'Authorization' header is missing.",
                {"WWW-Authenticate": challenge},
            )
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ArmError(
                401,
                "AuthenticationFailedInvalidHeader",
                "Authentication failed. The 'Authorization' header is provided in an invalid format.",
                {"WWW-Authenticate": challenge},
            )
        accepted = list(self.config["tokens"]) + (list(self.issued) if self.config["requireIssuedTokens"] else [])
        if (self.config["tokens"] or self.config["requireIssuedTokens"]) and token not in accepted:
            raise ArmError(
                401, "InvalidAuthenticationToken", "The access token is invalid.", {"WWW-Authenticate": challenge}
            )
        return token

    def _check_api_version(self, req: Request, route: Route) -> None:
        version = req.query.get("api-version")
        if version is None:
            raise ArmError(
                400,
                "MissingApiVersionParameter",
                "The api-version query parameter (?api-version=) is required for all requests.",
            )
        if version == route.api:
            return
        if route.rtype is None or not API_VERSION.match(version):
            raise ArmError(
                400,
                "InvalidApiVersionParameter",
                f"The api-version '{version}' is invalid. The supported versions are '{route.api}'.",
            )
        raise ArmError(
            400,
            "NoRegisteredProviderFound",
            f"No registered resource provider found for API version '{version}' for type "
            f"'{route.rtype.split('/', 1)[1]}'. The supported api-versions are '{route.api}'.",
        )

    def _take_fault(self, req: Request) -> Fault | None:
        fault = next((f for f in self.faults if f.matches(req)), None)
        if fault is None:
            return None
        fault.times -= 1
        if fault.times == 0:
            self.faults.remove(fault)
        if fault.status is not None:
            headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
            raise ArmError(fault.status, fault.code, fault.message, headers)
        return fault

    def _page(self, req: Request, items: list[dict]) -> Response:
        """One page of a list, with a nextLink (carrying $skiptoken) when more follow."""
        size = int(self.config["pageSize"])
        token = req.query.get("$skiptoken")
        offset = 0
        if token is not None:
            try:
                offset = int(base64.urlsafe_b64decode(token.encode()).decode().removeprefix("offset:"))
                if offset < 0:
                    raise ValueError(offset)
            except ValueError:
                raise ArmError(400, "InvalidRequestFormat", f"The $skiptoken '{token}' is invalid.") from None
        body: dict = {"value": items[offset : offset + size]}
        if offset + size < len(items):
            query = dict(req.query)
            query["$skiptoken"] = base64.urlsafe_b64encode(f"offset:{offset + size}".encode()).decode()
            body["nextLink"] = f"{req.base}{req.raw_path}?{urlencode(query, safe='$', quote_via=quote)}"
        return Response(200, body)

    def list_resources(self, req: Request, _async_error: dict | None) -> Response:
        """Resources - List (the subscription's resources, by tag or type)."""
        world = self.world
        sub = req.params["sub"]
        if sub.lower() not in world.subscriptions:
            raise ArmError(404, "SubscriptionNotFound", f"The subscription '{sub}' could not be found.")
        keep, show_tags = parse_filter(req.query.get("$filter"))
        rows = [
            model.render_generic(rid, rtype, loc, tags if show_tags else None)
            for rid, rtype, loc, tags in world.resources()
            if rid.lower().startswith(f"/subscriptions/{sub.lower()}/") and keep(rtype, tags)
        ]
        return self._page(req, rows)

    def list_public_ips(self, req: Request, _async_error: dict | None) -> Response:
        """Public IP Addresses - List (a resource group) and - List All (the subscription)."""
        world = self._view(req.now, stale=True)
        sub, rg = req.params["sub"], req.params.get("rg")
        if rg is None:
            if sub.lower() not in world.subscriptions:
                raise ArmError(404, "SubscriptionNotFound", f"The subscription '{sub}' could not be found.")
            scope = f"/subscriptions/{sub}/"
        else:
            world.require_group(sub, rg)
            scope = model.group_id(sub, rg) + "/"
        items = [
            model.render_public_ip(world, p)
            for k, p in sorted(world.public_ips.items())
            if k.startswith(scope.lower())
        ]
        return self._page(req, items)

    def get_public_ip(self, req: Request, _async_error: dict | None) -> Response:
        world = self._view(req.now, stale=True)
        sub, rg, name = req.params["sub"], req.params["rg"], req.params["name"]
        world.require_group(sub, rg)
        pip = world.public_ips.get(key(model.resource_id(sub, rg, PUBLIC_IP, name)))
        if pip is None:
            raise model.not_found(PUBLIC_IP, name, rg)
        return Response(200, model.render_public_ip(world, pip))

    def get_nic(self, req: Request, _async_error: dict | None) -> Response:
        world = self._view(req.now, stale=True)
        sub, rg, name = req.params["sub"], req.params["rg"], req.params["name"]
        world.require_group(sub, rg)
        nic = world.nics.get(key(model.resource_id(sub, rg, NIC, name)))
        if nic is None:
            raise model.not_found(NIC, name, rg)
        return Response(200, model.render_nic(nic))

    def list_nics(self, req: Request, _async_error: dict | None) -> Response:
        """Network Interfaces - List (a resource group's NICs, whole, as Get shows them)."""
        world = self._view(req.now, stale=True)
        sub, rg = req.params["sub"], req.params["rg"]
        world.require_group(sub, rg)
        scope = (model.group_id(sub, rg) + "/").lower()
        items = [model.render_nic(n) for k, n in sorted(world.nics.items()) if k.startswith(scope)]
        return self._page(req, items)

    def put_nic(self, req: Request, async_error: dict | None) -> Response:
        """Network Interfaces - Create Or Update: checked now, committed when its
        operation completes (asyncDelay later)."""
        sub, rg, name = req.params["sub"], req.params["rg"], req.params["name"]
        self.world.require_group(sub, rg)
        nic_id = model.resource_id(sub, rg, NIC, name)
        existing = self.world.nics.get(key(nic_id))
        retry = {"Retry-After": str(self.config["retryAfter"])}
        if any(key(o.nic.id) == key(nic_id) for o in self.ops.values() if o.status == "InProgress"):
            raise ArmError(
                429,
                "RetryableErrorDueToAnotherOperation",
                f"Operation on network interface {nic_id} is not allowed: another operation on it is in progress.",
                retry,
            )
        if_match = req.header("If-Match")
        if if_match is not None and (existing is None or if_match not in ("*", existing.etag)):
            raise ArmError(
                412,
                "PreconditionFailed",
                f"Precondition failed for resource {nic_id}: If-Match {if_match} is not its etag.",
            )
        nic = model.parse_nic(req.json(), nic_id, existing)
        model.check_nic(self.world, nic, existing, self._pending())
        op = Operation(
            id=str(uuid.uuid4()),
            nic=nic,
            created=existing is None,
            due=req.now + float(self.config["asyncDelay"]),
            error=async_error,
        )
        self.ops[op.id] = op
        if existing:
            existing.state = "Updating"
            self._commit(req.now)
        location = f"{req.base}/subscriptions/{sub}{NETWORK_PROVIDER}/locations/{nic.location}"
        headers = {
            "Azure-AsyncOperation": f"{location}/operations/{op.id}?api-version={NETWORK_API}",
            "Location": f"{location}/operationResults/{op.id}?api-version={NETWORK_API}",
            **retry,
        }
        return Response(201 if op.created else 200, model.render_nic(nic, state="Updating"), headers)

    def get_subnet(self, req: Request, _async_error: dict | None) -> Response:
        sub, rg = req.params["sub"], req.params["rg"]
        self.world.require_group(sub, rg)
        vnet_id = model.resource_id(sub, rg, model.VNET, req.params["vnet"])
        if key(vnet_id) not in self.world.vnets:
            raise model.not_found(model.VNET, req.params["vnet"], rg)
        subnet = self.world.subnets.get(key(f"{vnet_id}/subnets/{req.params['name']}"))
        if subnet is None:
            raise model.not_found(f"{model.VNET}/subnets", f"{req.params['vnet']}/{req.params['name']}", rg)
        return Response(200, model.render_subnet(self.world, subnet))

    def get_vm(self, req: Request, _async_error: dict | None) -> Response:
        sub, rg, name = req.params["sub"], req.params["rg"], req.params["name"]
        self.world.require_group(sub, rg)
        vm = self.world.vms.get(key(model.resource_id(sub, rg, VM, name)))
        if vm is None:
            raise model.not_found(VM, name, rg)
        return Response(200, model.render_vm(vm))

    def _operation(self, req: Request) -> Operation:
        op = self.ops.get(req.params["op"])
        if op is None or not key(op.nic.id).startswith(key(f"/subscriptions/{req.params['sub']}/")):
            raise ArmError(404, "NotFound", f"Operation {req.params['op']} was not found.")
        return op

    def get_operation(self, req: Request, _async_error: dict | None) -> Response:
        """The Azure-AsyncOperation URL: the operation's status."""
        op = self._operation(req)
        body: dict = {"name": op.id, "status": op.status}
        headers = {}
        if op.status == "InProgress":
            headers["Retry-After"] = str(self.config["retryAfter"])
        elif op.status == "Failed":
            body["error"] = dict(op.error)
        return Response(200, body, headers)

    def get_operation_result(self, req: Request, _async_error: dict | None) -> Response:
        """The Location URL: 202 while running, then the NIC (or the failure)."""
        op = self._operation(req)
        if op.status == "InProgress":
            url = f"{req.base}{req.raw_path}?{urlencode(req.query, safe='$', quote_via=quote)}"
            return Response(202, None, {"Location": url, "Retry-After": str(self.config["retryAfter"])})
        if op.status == "Failed":
            raise ArmError(500, op.error["code"], op.error["message"])
        return Response(200, model.render_nic(self.world.nics[key(op.nic.id)]))

    # ------------------------------------------------ Entra ID's token ---

    def entra_token(self, req: Request, tenant: str) -> Response:
        """Entra ID's token endpoint for the client credentials grant with a
        federated credential (what azure_identity's WorkloadIdentityCredential
        sends: README.md, "Entra ID's token endpoint"). Checks the form's
        fields, issues an opaque token and records the request (the
        assertion as sent, so a test can compare it with the token file)."""
        form = dict(parse_qsl(req.raw.decode("utf-8", "replace"), keep_blank_values=True))
        with self.lock:
            now = time.monotonic()
            entry = {
                "seq": len(self.token_log) + 1,
                "time": round(now - self.epoch, 6),
                "tenant": tenant,
                "clientId": form.get("client_id"),
                "scope": form.get("scope"),
                "grantType": form.get("grant_type"),
                "assertionType": form.get("client_assertion_type"),
                "assertion": form.get("client_assertion"),
            }
            self.token_log.append(entry)
            missing = [f for f in ("client_id", "scope", "grant_type", "client_assertion", "client_assertion_type") if not form.get(f)]
            if missing:
                entry["status"] = 400
                return Response(400, entra_error("invalid_request", 900144, f"The request body must contain the following parameter: '{missing[0]}'."))
            if form["grant_type"] != "client_credentials" or form["client_assertion_type"] != ASSERTION_TYPE:
                entry["status"] = 400
                return Response(400, entra_error("unsupported_grant_type", 70003, "The app requested an unsupported grant type."))
            if not form["scope"].endswith("/.default"):
                entry["status"] = 400
                return Response(400, entra_error("invalid_scope", 1002012, f"The provided value for scope {form['scope']} is not valid. Client credential flows must have a scope value with /.default suffixed to the resource identifier."))
            token = "eyJ0eXAiOiJKV1QifQ.emulated." + uuid.uuid4().hex
            self.issued.add(token)
            entry["status"] = 200
            return Response(200, {"token_type": "Bearer", "expires_in": TOKEN_TTL, "ext_expires_in": TOKEN_TTL, "access_token": token})

    # --------------------------------------------------------- control ---

    def control(self, method: str, path: str, raw: bytes) -> Response:
        """The control API under /_emulator/ (README.md, "Control API")."""
        with self.lock:
            self._advance(time.monotonic())
            try:
                return self._control(method, path.removeprefix("/_emulator/").strip("/"), raw)
            except ArmError as e:
                return error_response(e)
            except (ValueError, TypeError, AttributeError) as e:
                return error_response(control_error(f"malformed request: {e!r}"))

    def _control(self, method: str, what: str, raw: bytes) -> Response:
        try:
            body = json.loads(raw) if raw else None
        except ValueError as e:
            raise control_error(f"the body is not JSON: {e}") from None
        match (method, what):
            case ("GET", "health"):
                return Response(200, {"status": "ok"})
            case ("POST", "reset"):
                self.reset()
                return Response(200, {"status": "reset"})
            case ("POST", "seed"):
                world = copy.deepcopy(self.world)
                made = model.seed(world, body)
                self.world = world
                # Seeding sets the scene: stale reads see it at once.
                self.history = [(-math.inf, copy.deepcopy(world))]
                return Response(200, made)
            case ("GET", "config"):
                return Response(200, self.config)
            case ("PUT", "config"):
                self._configure(body)
                return Response(200, self.config)
            case ("GET", "faults"):
                return Response(200, [f.describe() for f in self.faults])
            case ("POST", "faults"):
                fault = parse_fault(body, self.next_fault)
                self.next_fault += 1
                self.faults.append(fault)
                return Response(200, fault.describe())
            case ("DELETE", "faults"):
                self.faults.clear()
                return Response(200, [])
            case ("GET", "requests"):
                return Response(200, self.log)
            case ("DELETE", "requests"):
                self.log.clear()
                return Response(200, [])
            case ("GET", "routing"):
                return Response(200, model.routing(self.world))
            case ("GET", "tokens"):
                return Response(200, self.token_log)
            case ("PUT", "tags"):
                return Response(200, self._set_tags(body))
        raise ArmError(404, "NotFound", f"no control call {method} /_emulator/{what}")

    def _set_tags(self, body: object) -> dict:
        """Replaces a public IP's tags, as an operator's Tags - Update At
        Scope would (the provider never calls it: a control call, not an
        emulated one). Committed at once; stale reads see it `staleness` later."""
        if not isinstance(body, dict) or not isinstance(body.get("tags"), dict) or not isinstance(body.get("id"), str):
            raise control_error("tags takes {id, tags}")
        pip = self.world.public_ips.get(key(body["id"]))
        if pip is None:
            raise control_error(f"no public IP address {body['id']}")
        pip.tags = {str(k): str(v) for k, v in body["tags"].items()}
        pip.etag = model.new_etag()
        self._commit(time.monotonic())
        return {"id": pip.id, "tags": pip.tags}

    def _configure(self, changes: object) -> None:
        if not isinstance(changes, dict):
            raise control_error("the config is a JSON object")
        config = dict(self.config)
        for name, value in changes.items():
            if name not in DEFAULTS:
                raise control_error(f"no setting '{name}' (the settings: {', '.join(DEFAULTS)})")
            if name == "tokens":
                if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                    raise control_error("'tokens' is a list of strings")
            elif name == "requireIssuedTokens":
                if not isinstance(value, bool):
                    raise control_error("'requireIssuedTokens' is a boolean")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise control_error(f"'{name}' is a number, at least 0")
            config[name] = value
        if config["readRefill"] <= 0 or config["writeRefill"] <= 0 or config["pageSize"] < 1:
            raise control_error("the refill rates must be above 0 and pageSize at least 1")
        self.config = config
        # New bucket sizes take effect with full buckets.
        self.buckets.clear()


def entra_error(error: str, code: int, description: str) -> dict:
    """Entra ID's error shape (the client credentials flow's "Error
    response example"): `error`, `error_description` beginning with the
    AADSTS code, `error_codes`. The codes and texts are the emulator's
    choice from Entra's published error code list, not captured answers."""
    return {
        "error": error,
        "error_description": f"AADSTS{code}: {description}",
        "error_codes": [code],
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
        "trace_id": str(uuid.uuid4()),
        "correlation_id": str(uuid.uuid4()),
    }


def route(method: str, pattern: str, api: str, rtype: str | None, handler) -> Route:
    return Route(method, re.compile(pattern, re.I), api, rtype, handler)


ROUTES = [
    route("GET", SUB + "/resources", RESOURCES_API, None, Emulator.list_resources),
    route("GET", SUB + NET + "/publicIPAddresses", NETWORK_API, PUBLIC_IP, Emulator.list_public_ips),
    route("GET", RG + NET + "/publicIPAddresses", NETWORK_API, PUBLIC_IP, Emulator.list_public_ips),
    route("GET", RG + NET + "/publicIPAddresses" + NAME, NETWORK_API, PUBLIC_IP, Emulator.get_public_ip),
    route("GET", RG + NET + "/networkInterfaces", NETWORK_API, NIC, Emulator.list_nics),
    route("GET", RG + NET + "/networkInterfaces" + NAME, NETWORK_API, NIC, Emulator.get_nic),
    route("PUT", RG + NET + "/networkInterfaces" + NAME, NETWORK_API, NIC, Emulator.put_nic),
    route(
        "GET",
        RG + NET + "/virtualNetworks/(?P<vnet>[^/]+)/subnets" + NAME,
        NETWORK_API,
        f"{model.VNET}/subnets",
        Emulator.get_subnet,
    ),
    route("GET", RG + r"/providers/Microsoft\.Compute/virtualMachines" + NAME, COMPUTE_API, VM, Emulator.get_vm),
    route(
        "GET",
        SUB + NET + "/locations/[^/]+/operations/(?P<op>[^/]+)",
        NETWORK_API,
        "Microsoft.Network/locations/operations",
        Emulator.get_operation,
    ),
    route(
        "GET",
        SUB + NET + "/locations/[^/]+/operationResults/(?P<op>[^/]+)",
        NETWORK_API,
        "Microsoft.Network/locations/operationResults",
        Emulator.get_operation_result,
    ),
]


def _assoc_ids(assoc: tuple | None) -> tuple[str, str] | None:
    return (key(assoc[0].id), assoc[1].name.lower()) if assoc else None


FILTER_TAG = re.compile(r"tagName eq '((?:[^']|'')*)'(?: and tagValue eq '((?:[^']|'')*)')?", re.I)
FILTER_TYPE = re.compile(r"resourceType eq '((?:[^']|'')*)'", re.I)


def parse_filter(text: str | None):
    """Resources - List's $filter, in the forms the emulator evaluates:
    (keep(type, tags) predicate, whether rows carry their tags). ARM leaves the
    tags out of the rows when filtering by tag."""
    if text is None:
        return (lambda _rtype, _tags: True), True
    text = text.strip()
    if m := FILTER_TAG.fullmatch(text):
        name = m.group(1).replace("''", "'").lower()
        value = m.group(2).replace("''", "'") if m.group(2) is not None else None

        def keep(_rtype: str, tags: dict[str, str]) -> bool:
            found = [v for k, v in tags.items() if k.lower() == name]
            return bool(found) and (value is None or found[0] == value)

        return keep, False
    if m := FILTER_TYPE.fullmatch(text):
        wanted = m.group(1).replace("''", "'").lower()
        return (lambda rtype, _tags: rtype.lower() == wanted), True
    raise ArmError(
        400,
        "InvalidFilterInQueryString",
        f"The $filter '{text}' is invalid: the emulator evaluates tagName eq '..' [and tagValue eq '..'] "
        "or resourceType eq '..'.",
    )


# ------------------------------------------------------------------ HTTP ---


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            resp = self._dispatch(raw)
        except Exception as e:  # an emulator bug: answered, not a dropped connection
            traceback.print_exc()
            resp = Response(500, {"error": {"code": "EmulatorBug", "message": repr(e)}})
        payload = b"" if resp.body is None else json.dumps(resp.body).encode()
        self.send_response(resp.status)
        if resp.body is not None:
            self.send_header("Content-Type", "application/json; charset=utf-8")
        for name, value in resp.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _dispatch(self, raw: bytes) -> Response:
        split = urlsplit(self.path)
        path = unquote(split.path)
        if path.startswith("/_emulator/"):
            return self.server.emulator.control(self.command, path, raw)
        if self.command == "POST" and (m := TOKEN_PATH.fullmatch(path)):
            return self.server.emulator.entra_token(Request(self.command, path, split.path, {}, dict(self.headers.items()), raw, ""), m["tenant"])
        host = self.headers.get("Host") or "%s:%d" % self.server.server_address[:2]
        req = Request(
            method=self.command,
            path=path,
            raw_path=split.path,
            query=dict(parse_qsl(split.query, keep_blank_values=True)),
            headers=dict(self.headers.items()),
            raw=raw,
            base=f"{self.server.scheme}://{host}",
        )
        return self.server.emulator.arm(req)

    do_GET = do_PUT = do_POST = do_PATCH = do_DELETE = _serve

    def log_message(self, format: str, *args) -> None:
        if self.server.verbose:
            super().log_message(format, *args)


class Server(ThreadingHTTPServer):
    """The emulator on one address: HTTPS when given a TLS context. The TLS
    handshake runs in the connection's thread, not the accepting one."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], tls: ssl.SSLContext | None = None, verbose: bool = False):
        self.emulator = Emulator()
        self.tls = tls
        self.scheme = "https" if tls else "http"
        self.verbose = verbose
        super().__init__(address, Handler)

    def finish_request(self, request, client_address) -> None:
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(30)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return None
        try:
            return super().finish_request(conn, client_address)
        finally:
            conn.close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{self.scheme}://{host}:{port}"


def tls_context(directory: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(directory / "server.pem", directory / "server.key")
    return ctx


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--port-file", type=Path, help="write the port here once listening")
    parser.add_argument("--tls-dir", type=Path, help="serve HTTPS with server.pem and server.key from here")
    parser.add_argument("--verbose", action="store_true", help="log every request to standard error")
    args = parser.parse_args(argv)
    server = Server((args.address, args.port), tls_context(args.tls_dir) if args.tls_dir else None, args.verbose)
    if args.port_file:
        tmp = args.port_file.with_name(args.port_file.name + ".tmp")
        tmp.write_text(f"{server.server_address[1]}\n")
        os.replace(tmp, args.port_file)
    print(f"ARM emulator listening on {server.url}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
