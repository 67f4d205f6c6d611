#!/usr/bin/env python3
"""An emulator of the Compute Engine REST calls that Egret's GCP provider makes
through the official Rust client (google-cloud-compute-v1 4.1.0).

It is not Google Cloud: it answers exactly the calls listed in README.md (beside
this file), with the request and response shapes of the published REST
reference, long-running operations that take effect only when DONE, Google's
JSON error format, per-minute rate quotas, stale reads and injected faults.
A control API under /_emulator/ seeds it, arms faults, reads the request log
and the "routing truth" (which instance each external address reaches now).

Python 3.11 standard library only. Run `gcp_emulator.py --help`; the lifecycle
script gcp-emulator.sh starts and stops it for the tests.
"""

import argparse
import base64
import copy
import heapq
import ipaddress
import itertools
import json
import os
import re
import secrets
import socket
import ssl
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

# Links in resources use the host Compute Engine writes into selfLinks; both
# hosts are accepted in references (the client's default endpoint is the other).
LINK = "https://www.googleapis.com/compute/v1/"
URL_PREFIXES = (LINK, "https://compute.googleapis.com/compute/v1/")

# The canonical status names of HTTP codes (google.rpc.Code), as in the
# "status" member of Google's JSON errors.
STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    412: "FAILED_PRECONDITION",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# Operation.httpErrorMessage: the upper-cased reason phrase ("NOT FOUND").
HTTP_MESSAGES = {
    400: "BAD REQUEST",
    403: "FORBIDDEN",
    404: "NOT FOUND",
    409: "CONFLICT",
    412: "PRECONDITION FAILED",
    429: "TOO MANY REQUESTS",
    500: "INTERNAL SERVER ERROR",
    503: "SERVICE UNAVAILABLE",
}
# The errors[].reason an injected fault answers when the test names none.
FAULT_REASONS = {
    400: "invalid",
    403: "rateLimitExceeded",
    404: "notFound",
    409: "alreadyExists",
    412: "conditionNotMet",
    429: "rateLimitExceeded",
    500: "backendError",
    503: "backendError",
}

NAME_RE = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?\Z")
NAME_RULE = "Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'"
# Protocol forwarding's IPProtocol values (ForwardingRule.IPProtocol's reference).
FORWARDING_PROTOCOLS = ("TCP", "UDP", "ESP", "AH", "SCTP", "ICMP", "L3_DEFAULT")
MAX_RESULTS = 500
LOG_LIMIT = 10000
DEFAULT_CONFIG = {
    "operationDelay": 0.2,  # seconds from a mutation to its operation's DONE
    "staleness": 0.0,  # seconds address and forwarding-rule reads lag behind
    "pageSize": MAX_RESULTS,  # the most items a list page holds (maxResults caps it further)
    "allowAnonymous": False,  # answer requests that carry no Authorization header
    "waitCap": 120.0,  # the longest an operations .../wait call blocks
    "quota": {"read": 0, "mutation": 0, "window": 60.0},  # requests per window; 0 = no limit
    # Compute accepts only the tokens the emulated metadata server issued (and
    # those in `tokens`); false accepts any Bearer token (README.md, "Authentication").
    "requireIssuedTokens": False,
    "tokens": [],  # more accepted tokens (a test's own calls) when requireIssuedTokens
}

# The emulated metadata server (README.md, "The metadata server"): the
# default service account's email and the universe domain it answers.
METADATA_EMAIL = "egret-gateways@egret-lab.iam.gserviceaccount.com"
METADATA_UNIVERSE = "googleapis.com"
METADATA_TOKEN_TTL = 3599


class TEXT(str):
    """A plain-text answer (the metadata server's values), sent as is."""


class ApiError(Exception):
    """An error answered in Google's JSON error format."""

    def __init__(self, code, reason, message, domain="global", headers=None):
        super().__init__(message)
        self.code, self.reason, self.message, self.domain = code, reason, message, domain
        self.headers = headers or {}

    def body(self):
        return {
            "error": {
                "code": self.code,
                "message": self.message,
                "errors": [{"message": self.message, "domain": self.domain, "reason": self.reason}],
                "status": STATUS_NAMES.get(self.code, "UNKNOWN"),
            }
        }


def not_found(path):
    return ApiError(404, "notFound", f"The resource '{path}' was not found")


def invalid(field, value, why):
    return ApiError(400, "invalid", f"Invalid value for field '{field}': '{value}'. {why}")


class OperationFailure(Exception):
    """Ends an operation DONE with error.errors[] and httpErrorStatusCode."""

    def __init__(self, code, message, http=400):
        super().__init__(message)
        self.code, self.message, self.http = code, message, http


class ControlError(Exception):
    """A bad control-API request (answered as {"error": message}, 400)."""


def rfc3339(t):
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def fingerprint():
    # Compute's fingerprints are 8 bytes, base64 with the URL-safe alphabet: the
    # client decodes them with serde_with's Base64<UrlSafe>.
    return base64.urlsafe_b64encode(secrets.token_bytes(8)).decode()


def decode_fingerprint(value):
    try:
        return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (ValueError, TypeError):
        return None


# ------------------------------------------------------------------ filter ---
# The subset of the list filter grammar the reference describes for AIP-160
# expressions: `field op value` with op one of `=`, `!=`, `:` (substring on
# strings, `:*` for "defined"), values double-quoted or bare, comparisons
# joined by whitespace or AND, each optionally parenthesized. Everything else
# (OR, NOT, <, >, the regular-expression `eq`/`ne` form) is answered 400.

_FILTER_TOKEN = re.compile(
    r"""\s*(?:(?P<lp>\()|(?P<rp>\))|(?P<op>!=|=|:)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<word>[^\s()"'=!:<>]+)|(?P<bad>\S))"""
)
_FIELD = re.compile(r"[A-Za-z][\w-]*(?:\.[\w-]+)*\Z")
_KEYWORDS = ("AND", "OR", "NOT")


class FilterError(Exception):
    pass


def parse_filter(text):
    """A parsed filter: ("and", [node...]) or ("cmp", field, op, value, is_pattern)."""
    tokens = []
    for m in _FILTER_TOKEN.finditer(text):
        kind = m.lastgroup
        if kind is None:
            continue
        if kind == "bad":
            raise FilterError(f"unexpected {m.group(kind)!r}")
        tokens.append((kind, m.group(kind)))
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else (None, None)

    def take(kind):
        nonlocal pos
        k, v = peek()
        if k != kind:
            raise FilterError(f"expected {kind}, found {v!r}")
        pos += 1
        return v

    def conjunction():
        nonlocal pos
        terms = [term()]
        while peek()[0] not in (None, "rp"):
            if peek() == ("word", "AND"):
                pos += 1
            terms.append(term())
        return ("and", terms)

    def term():
        nonlocal pos
        if peek()[0] == "lp":
            pos += 1
            inner = conjunction()
            take("rp")
            return inner
        field = take("word")
        if field in _KEYWORDS or not _FIELD.match(field):
            raise FilterError(f"not a field: {field!r}")
        op = take("op")
        kind, value = peek()
        if kind == "str":
            pos += 1
            return ("cmp", field, op, re.sub(r"\\(.)", r"\1", value[1:-1]), False)
        value = take("word")
        if value in _KEYWORDS:
            raise FilterError(f"not a value: {value!r}")
        if value == "*":
            if op != ":":
                raise FilterError("'*' is only defined after ':'")
            return ("cmp", field, op, value, True)
        return ("cmp", field, op, value, False)

    tree = conjunction()
    if pos != len(tokens):
        raise FilterError(f"unexpected {tokens[pos][1]!r}")
    return tree


def _field_values(resource, path):
    values = [resource]
    for part in path.split("."):
        found = []
        for v in values:
            if isinstance(v, dict) and part in v:
                found.extend(v[part] if isinstance(v[part], list) else [v[part]])
            elif isinstance(v, list):
                found.extend(x[part] for x in v if isinstance(x, dict) and part in x)
        values = found
    return [v for v in values if not isinstance(v, (dict, list))]


def _scalar(v):
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def filter_matches(node, resource):
    if node[0] == "and":
        return all(filter_matches(n, resource) for n in node[1])
    _, field, op, value, is_pattern = node
    raw = _field_values(resource, field)
    values = [_scalar(v) for v in raw]
    if is_pattern:
        return bool(values)
    if op == "=":
        return value in values
    if op == "!=":
        return value not in values
    # ':' matches substrings of string fields and is '=' for the others.
    return any(value in s if isinstance(v, str) else s == value for v, s in zip(raw, values))


# ----------------------------------------------------------------- history ---


class History:
    """Every committed version of one collection's resources, keyed by
    (scope, name), so that reads can be served as of an earlier moment."""

    def __init__(self):
        self._versions = {}  # key -> [(commit time, resource or None when deleted)]

    def put(self, key, t, resource):
        versions = self._versions.setdefault(key, [])
        if versions and versions[-1][1] == resource:
            return
        versions.append((t, copy.deepcopy(resource)))

    def get(self, key, at=None):
        for t, resource in reversed(self._versions.get(key, ())):
            if at is None or t <= at:
                return resource
        return None

    def items(self, at=None):
        return {key: r for key in self._versions if (r := self.get(key, at)) is not None}

    def prune(self, before):
        """Forgets versions nobody can read any more: all but the newest one
        committed at or before `before`, and keys deleted before then."""
        for key in list(self._versions):
            versions = self._versions[key]
            older = [i for i, (t, _) in enumerate(versions) if t <= before]
            if older:
                del versions[: older[-1]]
            if len(versions) == 1 and versions[0][1] is None and versions[0][0] <= before:
                del self._versions[key]


# ------------------------------------------------------------------ routes ---


class Route:
    def __init__(self, method, template, api, handler, params=(), group="read"):
        self.method, self.api, self.handler, self.params, self.group = method, api, handler, params, group
        pattern = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", template)
        self.regex = re.compile(r"/compute/v1/projects/(?P<project>[^/]+)/" + pattern + r"\Z")


LIST = ("filter", "maxResults", "orderBy", "pageToken", "returnPartialSuccess")
AGGREGATED = LIST + ("includeAllScopes", "serviceProjectNumber")
# The query parameters of each call are the ones google-cloud-compute-v1's
# transport.rs sends for it; `$alt`, `$apiVersion` and `prettyPrint` are the
# system parameters every call may carry.
ROUTES = [
    Route("GET", "regions/{region}/addresses", "addresses.list", "list_scoped", LIST),
    Route("GET", "regions/{region}/addresses/{name}", "addresses.get", "get_scoped"),
    Route("GET", "aggregated/addresses", "addresses.aggregatedList", "list_aggregated", AGGREGATED),
    Route("GET", "regions/{region}/forwardingRules", "forwardingRules.list", "list_scoped", LIST),
    Route("GET", "regions/{region}/forwardingRules/{name}", "forwardingRules.get", "get_scoped", ("view",)),
    Route("GET", "aggregated/forwardingRules", "forwardingRules.aggregatedList", "list_aggregated", AGGREGATED),
    Route("POST", "regions/{region}/forwardingRules", "forwardingRules.insert", "insert_forwarding_rule", ("requestId",), "mutation"),
    Route("DELETE", "regions/{region}/forwardingRules/{name}", "forwardingRules.delete", "delete_forwarding_rule", ("requestId",), "mutation"),
    Route("POST", "regions/{region}/forwardingRules/{name}/setTarget", "forwardingRules.setTarget", "set_target", ("requestId",), "mutation"),
    Route("GET", "zones/{zone}/targetInstances", "targetInstances.list", "list_scoped", LIST),
    Route("GET", "zones/{zone}/targetInstances/{name}", "targetInstances.get", "get_scoped"),
    Route("GET", "aggregated/targetInstances", "targetInstances.aggregatedList", "list_aggregated", AGGREGATED),
    Route("POST", "zones/{zone}/targetInstances", "targetInstances.insert", "insert_target_instance", ("requestId",), "mutation"),
    Route("DELETE", "zones/{zone}/targetInstances/{name}", "targetInstances.delete", "delete_target_instance", ("requestId",), "mutation"),
    Route("GET", "zones/{zone}/instances", "instances.list", "list_scoped", LIST),
    Route("GET", "zones/{zone}/instances/{name}", "instances.get", "get_scoped"),
    Route("GET", "aggregated/instances", "instances.aggregatedList", "list_aggregated", AGGREGATED),
    Route("POST", "zones/{zone}/instances/{name}/addAccessConfig", "instances.addAccessConfig", "add_access_config", ("networkInterface", "requestId"), "mutation"),
    Route("POST", "zones/{zone}/instances/{name}/deleteAccessConfig", "instances.deleteAccessConfig", "delete_access_config", ("accessConfig", "networkInterface", "requestId"), "mutation"),
    Route("PATCH", "zones/{zone}/instances/{name}/updateNetworkInterface", "instances.updateNetworkInterface", "update_network_interface", ("networkInterface", "requestId"), "mutation"),
    Route("GET", "regions/{region}/subnetworks/{name}", "subnetworks.get", "get_subnetwork", ("views",)),
    Route("GET", "zones/{zone}/operations/{name}", "zoneOperations.get", "get_operation"),
    Route("POST", "zones/{zone}/operations/{name}/wait", "zoneOperations.wait", "wait_operation"),
    Route("GET", "regions/{region}/operations/{name}", "regionOperations.get", "get_operation"),
    Route("POST", "regions/{region}/operations/{name}/wait", "regionOperations.wait", "wait_operation"),
    Route("GET", "global/operations/{name}", "globalOperations.get", "get_operation"),
    Route("POST", "global/operations/{name}/wait", "globalOperations.wait", "wait_operation"),
]
SYSTEM_PARAMS = ("$alt", "alt", "$apiVersion", "prettyPrint")

# Per collection: the kind of scope it lives in and its resources' kind (a
# scoped list in aggregatedList's items holds them under the collection's name).
COLLECTIONS = {
    "addresses": ("regions", "compute#address"),
    "forwardingRules": ("regions", "compute#forwardingRule"),
    "targetInstances": ("zones", "compute#targetInstance"),
    "instances": ("zones", "compute#instance"),
}


def default_seed():
    """A small lab: two gateway instances in two zones of one region, four
    reserved external addresses (two in pool "lab", one in pool "other", one
    unlabelled). Documentation ranges only (RFC 2544, RFC 5737)."""
    return {
        "project": "egret-lab",
        "regions": {"us-central1": ["us-central1-a", "us-central1-b"]},
        "networks": ["lab"],
        "subnetworks": [
            {
                "name": "gateways",
                "region": "us-central1",
                "network": "lab",
                "ipCidrRange": "198.18.1.0/24",
                "secondaryIpRanges": [{"rangeName": "pods", "ipCidrRange": "198.18.64.0/18"}],
            }
        ],
        "instances": [
            {"name": "gw-a", "zone": "us-central1-a", "canIpForward": True, "networkInterfaces": [{"subnetwork": "gateways", "networkIP": "198.18.1.10"}]},
            {"name": "gw-b", "zone": "us-central1-b", "canIpForward": True, "networkInterfaces": [{"subnetwork": "gateways", "networkIP": "198.18.1.11"}]},
        ],
        "addresses": [
            {"name": "egress-1", "region": "us-central1", "address": "203.0.113.10", "labels": {"egret-pool": "lab"}},
            {"name": "egress-2", "region": "us-central1", "address": "203.0.113.11", "labels": {"egret-pool": "lab"}},
            {"name": "egress-other", "region": "us-central1", "address": "203.0.113.20", "labels": {"egret-pool": "other"}},
            {"name": "unlabelled", "region": "us-central1", "address": "203.0.113.30"},
        ],
    }


# ---------------------------------------------------------------- emulator ---


class Emulator:
    """The emulated project: state, operations, faults, quotas and the request
    log. Every public method is safe to call from any thread."""

    def __init__(self, config=None):
        self._cond = threading.Condition()
        self.config = copy.deepcopy(DEFAULT_CONFIG)
        if config:
            self._set_config(config)
        self._ids = itertools.count(secrets.randbelow(10**18) + 10**18)
        self._seq = itertools.count()
        self._log = deque(maxlen=LOG_LIMIT)
        self._log_seq = itertools.count()
        self._issued = set()  # access tokens the metadata server issued
        self.reset()

    def reset(self, seed=None):
        """Forgets everything but the configuration and seeds anew (the
        default lab when `seed` is None)."""
        with self._cond:
            self._clear()
            self._log.clear()
            self._apply_seed(default_seed() if seed is None else seed, time.time())

    # ---- state -------------------------------------------------------------

    def _clear(self):
        self.project = "egret-lab"
        self.zones = {}  # zone -> region
        self.regions = {}  # region -> [zone]
        self.networks = {}  # name -> selfLink
        self.subnetworks = {}  # (region, name) -> resource
        self.instances = {}  # (zone, name) -> resource
        self.target_instances = {}  # (zone, name) -> resource
        self.addresses = History()  # (region, name) -> resource
        self.forwarding_rules = History()  # (region, name) -> resource
        self._ops = {}  # (scope kind, scope, name) -> operation record
        self._queue = []  # heap of (due, seq, operation key)
        self._pending = set()  # (collection, scope, name) of inserts not yet DONE
        self._request_ids = {}  # requestId -> operation key
        self._faults = []
        self._fault_ids = itertools.count(1)
        self._quota_used = {}  # group -> (window number, requests)

    def _link(self, *parts):
        return LINK + "/".join(("projects", self.project) + parts)

    def _path(self, *parts):
        return "/".join(("projects", self.project) + parts)

    def _new_id(self):
        return str(next(self._ids))

    def _collection(self, name):
        """The (scope, name) -> resource map of a collection; addresses and
        forwarding rules as of `staleness` seconds ago (eventual consistency)."""
        if name in ("addresses", "forwardingRules"):
            history = self.addresses if name == "addresses" else self.forwarding_rules
            stale = self.config["staleness"]
            return history.items(time.time() - stale if stale > 0 else None)
        return self.instances if name == "instances" else self.target_instances

    def _check_scope(self, kind, scope):
        known = self.regions if kind == "regions" else self.zones
        if scope not in known:
            field = "region" if kind == "regions" else "zone"
            raise invalid(field, scope, f"Unknown {field}.")

    def _scope_of(self, params):
        return ("regions", params["region"]) if "region" in params else ("zones", params["zone"])

    def _relative(self, value):
        """A full or partial resource URL as "projects/P/..."."""
        rest = value
        for prefix in URL_PREFIXES:
            if rest.startswith(prefix):
                rest = rest[len(prefix):]
                break
        rest = rest.lstrip("/")
        return rest if rest.startswith("projects/") else f"projects/{self.project}/{rest}"

    def _parse_ref(self, value, collection, scope_kind, default_scope=None):
        """(scope, name) of a full or partial resource URL of this project, or
        of a bare name when `default_scope` is given; None when it is neither."""
        if not isinstance(value, str) or not value:
            return None
        if "/" not in value:
            return (default_scope, value) if default_scope else None
        parts = self._relative(value).split("/")
        if len(parts) == 6 and parts[1] == self.project and parts[2] == scope_kind and parts[4] == collection and parts[5]:
            return parts[3], parts[5]
        return None

    def _network_link(self, value):
        """The selfLink of the network a URL, partial URL or name names, or None."""
        if not isinstance(value, str) or not value:
            return None
        parts = self._relative(value).split("/") if "/" in value else ["projects", self.project, "global", "networks", value]
        if len(parts) == 5 and parts[1] == self.project and parts[2:4] == ["global", "networks"]:
            return self.networks.get(parts[4])
        return None

    # ---- seeding -----------------------------------------------------------

    def _apply_seed(self, seed, t):
        if not isinstance(seed, dict):
            raise ControlError("a seed is a JSON object")
        try:
            self.project = seed.get("project", self.project)
            for region, zones in seed.get("regions", {}).items():
                self.regions[region] = list(zones)
                for zone in zones:
                    self.zones[zone] = region
            for name in seed.get("networks", []):
                self.networks[name] = self._link("global", "networks", name)
            for spec in seed.get("subnetworks", []):
                self._seed_subnetwork(spec, t)
            for spec in seed.get("instances", []):
                self._seed_instance(spec, t)
            for spec in seed.get("addresses", []):
                self._seed_address(spec, t)
            for spec in seed.get("targetInstances", []):
                self._seed_target_instance(spec, t)
            for spec in seed.get("forwardingRules", []):
                self._seed_forwarding_rule(spec, t)
        except (KeyError, TypeError, ValueError) as e:
            raise ControlError(f"seed: {type(e).__name__}: {e}") from e
        except ApiError as e:
            raise ControlError(f"seed: {e.message}") from e
        self._refresh_addresses(t)

    def _seed_subnetwork(self, spec, t):
        region, name = spec["region"], spec["name"]
        self._check_scope("regions", region)
        if spec["network"] not in self.networks:
            raise ValueError(f"subnetwork {name}: unknown network {spec['network']}")
        cidr = ipaddress.ip_network(spec["ipCidrRange"])
        secondary = [
            {"rangeName": r["rangeName"], "ipCidrRange": str(ipaddress.ip_network(r["ipCidrRange"]))}
            for r in spec.get("secondaryIpRanges", [])
        ]
        self.subnetworks[(region, name)] = {
            "kind": "compute#subnetwork",
            "id": self._new_id(),
            "creationTimestamp": rfc3339(t),
            "name": name,
            "network": self.networks[spec["network"]],
            "ipCidrRange": str(cidr),
            # Compute reserves the range's second address for the gateway.
            "gatewayAddress": spec.get("gatewayAddress", str(cidr.network_address + 1)),
            "region": self._link("regions", region),
            "selfLink": self._link("regions", region, "subnetworks", name),
            "secondaryIpRanges": secondary,
            "fingerprint": fingerprint(),
            "privateIpGoogleAccess": False,
            "purpose": "PRIVATE",
            "stackType": "IPV4_ONLY",
        }

    def _seed_instance(self, spec, t):
        zone, name = spec["zone"], spec["name"]
        self._check_scope("zones", zone)
        region = self.zones[zone]
        nics = []
        for i, nic in enumerate(spec.get("networkInterfaces", [])):
            subnet = self.subnetworks[(region, nic["subnetwork"])]
            if ipaddress.ip_address(nic["networkIP"]) not in ipaddress.ip_network(subnet["ipCidrRange"]):
                raise ValueError(f"instance {name}: {nic['networkIP']} is not in {subnet['ipCidrRange']}")
            nics.append({
                "kind": "compute#networkInterface",
                "name": f"nic{i}",
                "network": subnet["network"],
                "subnetwork": subnet["selfLink"],
                "networkIP": nic["networkIP"],
                "stackType": "IPV4_ONLY",
                "fingerprint": fingerprint(),
                "accessConfigs": [self._access_config(ac) for ac in nic.get("accessConfigs", [])],
                "aliasIpRanges": [self._alias_range(r, subnet, f"nic{i}")[0] for r in nic.get("aliasIpRanges", [])],
            })
        self.instances[(zone, name)] = {
            "kind": "compute#instance",
            "id": self._new_id(),
            "creationTimestamp": rfc3339(t),
            "name": name,
            "zone": self._link("zones", zone),
            "machineType": self._link("zones", zone, "machineTypes", spec.get("machineType", "e2-small")),
            "status": spec.get("status", "RUNNING"),
            "canIpForward": bool(spec.get("canIpForward", False)),
            "networkInterfaces": nics,
            "labels": dict(spec.get("labels", {})),
            "labelFingerprint": fingerprint(),
            "selfLink": self._link("zones", zone, "instances", name),
        }

    def _seed_address(self, spec, t):
        region, name = spec["region"], spec["name"]
        self._check_scope("regions", region)
        address = str(ipaddress.ip_address(spec["address"]))
        for (r, n), other in self.addresses.items().items():
            if r == region and n != name and other["address"] == address:
                raise ValueError(f"address {name}: {address} is already address {n}")
        resource = {
            "kind": "compute#address",
            "id": self._new_id(),
            "creationTimestamp": rfc3339(t),
            "name": name,
            "description": spec.get("description", ""),
            "address": address,
            "addressType": spec.get("addressType", "EXTERNAL"),
            "region": self._link("regions", region),
            "selfLink": self._link("regions", region, "addresses", name),
            "status": "RESERVED",
            "labels": dict(spec.get("labels", {})),
            "labelFingerprint": fingerprint(),
        }
        if resource["addressType"] == "EXTERNAL":
            resource["networkTier"] = spec.get("networkTier", "PREMIUM")
        else:
            subnet = self.subnetworks[(region, spec["subnetwork"])]
            resource.update(subnetwork=subnet["selfLink"], purpose=spec.get("purpose", "GCE_ENDPOINT"))
        self.addresses.put((region, name), _seeded_at(self.addresses, (region, name), t), resource)

    def _seed_target_instance(self, spec, t):
        zone = spec["zone"]
        self._check_scope("zones", zone)
        body = {k: v for k, v in spec.items() if k != "zone"}
        _, resource = self._target_instance_from(zone, body, self._new_id())
        resource["creationTimestamp"] = rfc3339(t)
        self.target_instances[(zone, resource["name"])] = resource

    def _seed_forwarding_rule(self, spec, t):
        region = spec["region"]
        self._check_scope("regions", region)
        body = {k: v for k, v in spec.items() if k != "region"}
        resource = self._forwarding_rule_from(region, body, self._new_id())
        resource["creationTimestamp"] = rfc3339(t)
        key = (region, resource["name"])
        self.forwarding_rules.put(key, _seeded_at(self.forwarding_rules, key, t), resource)

    # ---- derived state -----------------------------------------------------

    def _address_users(self):
        """ip -> selfLinks of the DONE resources that use it: forwarding rules
        (IPAddress) and instances (an access config's natIP)."""
        users = {}
        for rule in self.forwarding_rules.items().values():
            users.setdefault((rule["region"], rule["IPAddress"]), []).append(rule["selfLink"])
        for (zone, _), inst in self.instances.items():
            region_link = self._link("regions", self.zones[zone])
            for nic in inst["networkInterfaces"]:
                for ac in nic["accessConfigs"]:
                    if "natIP" in ac:
                        users.setdefault((region_link, ac["natIP"]), []).append(inst["selfLink"])
        return users

    def _refresh_addresses(self, t):
        """Recomputes every address's users and status (IN_USE or RESERVED)
        after a commit, as a new version where they changed."""
        users = self._address_users()
        for key, address in self.addresses.items().items():
            updated = dict(address)
            updated.pop("users", None)
            found = sorted(users.get((address["region"], address["address"]), []))
            if found:
                updated["users"] = found
            updated["status"] = "IN_USE" if found else "RESERVED"
            self.addresses.put(key, t, updated)
        keep = max(self.config["staleness"], 0.0) + 1.0
        self.addresses.prune(t - keep)
        self.forwarding_rules.prune(t - keep)

    def routing(self):
        """The routing truth: where the network delivers each reserved external
        address now (DONE state, never stale), and each alias IP range."""
        with self._cond:
            self._tick()
            by_link = {inst["selfLink"]: (zone, inst) for (zone, _), inst in self.instances.items()}

            def reached(inst_link, nic_name=None, network=None):
                zone, inst = by_link[inst_link]
                nic = next((n for n in inst["networkInterfaces"] if nic_name in (None, n["name"]) and network in (None, n["network"])), None)
                return {
                    "zone": zone,
                    "name": inst["name"],
                    "selfLink": inst["selfLink"],
                    "status": inst["status"],
                    "networkInterface": nic["name"] if nic else None,
                    "networkIP": nic["networkIP"] if nic else None,
                }

            rules = self.forwarding_rules.items()
            out = []
            for (region, name), address in sorted(self.addresses.items().items()):
                if address["addressType"] != "EXTERNAL":
                    continue
                routes = []
                for (r, _), rule in sorted(rules.items()):
                    if r != region or rule["IPAddress"] != address["address"]:
                        continue
                    ti = self.target_instances.get(self._parse_ref(rule["target"], "targetInstances", "zones") or ())
                    routes.append({
                        "via": "forwardingRule",
                        "forwardingRule": rule["selfLink"],
                        "IPProtocol": rule["IPProtocol"],
                        "targetInstance": rule["target"],
                        "instance": reached(ti["instance"], network=ti.get("network")) if ti else None,
                    })
                for link, (zone, inst) in sorted(by_link.items()):
                    for nic in inst["networkInterfaces"]:
                        if self.zones[zone] == region and any(ac.get("natIP") == address["address"] for ac in nic["accessConfigs"]):
                            routes.append({"via": "accessConfig", "IPProtocol": "ALL", "instance": reached(link, nic["name"])})
                targets = {json.dumps(r["instance"], sort_keys=True) for r in routes}
                out.append({
                    "name": name,
                    "region": region,
                    "address": address["address"],
                    "labels": address.get("labels", {}),
                    "routes": routes,
                    # The one instance every route reaches, or null (none, or several).
                    "instance": routes[0]["instance"] if len(targets) == 1 else None,
                })
            aliases = [
                {"ipCidrRange": r["ipCidrRange"], "instance": reached(link, nic["name"])}
                for link, (_, inst) in sorted(by_link.items())
                for nic in inst["networkInterfaces"]
                for r in nic["aliasIpRanges"]
            ]
            return {"addresses": out, "aliasIpRanges": aliases}

    # ---- operations --------------------------------------------------------

    def _tick(self):
        """Commits every operation whose delay has run out, in order. Called
        under the lock at the start of every request, which is all it takes:
        nothing observes the state but requests."""
        now = time.time()
        while self._queue and self._queue[0][0] <= now:
            _, _, key = heapq.heappop(self._queue)
            self._commit(self._ops[key])

    def _commit(self, op):
        t = op["due"]
        try:
            forced = op["forcedError"]
            if forced:
                raise OperationFailure(forced["code"], forced["message"], forced["httpStatus"])
            op["apply"](t)
        except OperationFailure as f:
            op["error"] = {"errors": [{"code": f.code, "message": f.message}]}
            op["httpErrorStatusCode"] = f.http
            op["httpErrorMessage"] = HTTP_MESSAGES.get(f.http, "ERROR")
        finally:
            self._pending.discard(op["reserves"])
            op["done"] = True
        self._refresh_addresses(t)
        self._cond.notify_all()

    def _replayed(self, query):
        """The operation of an earlier request with this requestId, if any.
        The reference: "If you make the request again with the same request ID,
        the server can check if original operation with the same request ID was
        received, and if so, will ignore the second request." """
        request_id = query.get("requestId")
        if request_id is None:
            return None
        try:
            valid = uuid.UUID(request_id).int != 0
        except ValueError:
            valid = False
        if not valid:
            raise invalid("requestId", request_id, "Must be a valid UUID other than the zero UUID.")
        key = self._request_ids.get(request_id)
        return self._render_operation(self._ops[key]) if key else None

    def _operation(self, scope, op_type, target_link, target_id, apply, query, fault, reserves=None):
        """Starts a zonal or regional operation that applies `apply(commit
        time)` when it reaches DONE, `operationDelay` seconds from now, and
        answers it."""
        request_id = query.get("requestId")
        now = time.time()
        delay = self.config["operationDelay"]
        name = f"operation-{int(now * 1000)}-{secrets.token_hex(7)}-{secrets.token_hex(4)}-{secrets.token_hex(4)}"
        kind, where = scope
        op = {
            "resource": {
                "kind": "compute#operation",
                "id": self._new_id(),
                "name": name,
                "operationType": op_type,
                "targetLink": target_link,
                "targetId": target_id,
                "user": "emulator-user@example.com",
                "insertTime": rfc3339(now),
                "selfLink": self._link(kind, where, "operations", name),
                kind[:-1]: self._link(kind, where),  # "zone" or "region"
            },
            "runningAt": now + delay / 2,
            "due": now + delay,
            "done": False,
            "apply": apply,
            "forcedError": fault.get("operationError") if fault else None,
            "reserves": reserves,
        }
        key = (kind, where, name)
        self._ops[key] = op
        if reserves:
            self._pending.add(reserves)
        if request_id is not None:
            self._request_ids[request_id] = key
        heapq.heappush(self._queue, (op["due"], next(self._seq), key))
        self._tick()
        return self._render_operation(op)

    def _render_operation(self, op):
        r = dict(op["resource"])
        now = time.time()
        if op["done"]:
            r.update(status="DONE", progress=100, startTime=rfc3339(op["runningAt"]), endTime=rfc3339(op["due"]))
            for k in ("error", "httpErrorStatusCode", "httpErrorMessage"):
                if k in op:
                    r[k] = op[k]
        elif now >= op["runningAt"]:
            r.update(status="RUNNING", progress=0, startTime=rfc3339(op["runningAt"]))
        else:
            r.update(status="PENDING", progress=0)
        return r

    def _find_operation(self, params):
        kind, where = self._scope_of(params) if ("region" in params or "zone" in params) else ("global", None)
        if kind != "global":
            self._check_scope(kind, where)
        op = self._ops.get((kind, where, params["name"]))
        if op is None:
            parts = (kind, where, "operations", params["name"]) if where else ("global", "operations", params["name"])
            raise not_found(self._path(*parts))
        return op

    # ---- request handling --------------------------------------------------

    def handle(self, method, target, headers, body):
        """Answers one HTTP request: (status, JSON-able payload, extra headers)."""
        split = urlsplit(target)
        # The client joins its endpoint and the path; an endpoint ending in "/"
        # (as the client's default one does) gives "//compute/v1/...".
        path = re.sub(r"^/+", "/", split.path)
        if path.startswith("/_emulator/"):
            return self._control(method, path, split.query, body)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        if path.startswith("/computeMetadata/"):
            return self._metadata(method, path, query, headers)
        entry = {
            "seq": next(self._log_seq),
            "time": time.time(),
            "method": method,
            "path": path,
            "query": query,
            "body": _logged_body(body),
            "authorization": _auth_kind(headers),
            "api": None,
            "status": None,
        }
        with self._cond:
            self._log.append(entry)
        try:
            route, params = self._match(method, path)
            entry["api"] = route.api
            self._authenticate(headers)
            with self._cond:
                fault = self._take_fault(method, path, route)
            if fault and fault.get("stall"):
                time.sleep(fault["stall"])
            if fault and fault.get("status"):
                raise ApiError(fault["status"], fault["reason"], fault["message"], fault["domain"])
            with self._cond:
                self._tick()
                self._charge(route.group)
                self._check_query(route, query)
                if params["project"] != self.project:
                    raise not_found(f"projects/{params['project']}")
                parsed = _parse_body(body)
                if route.handler == "wait_operation":
                    payload = self._wait_operation(params)
                elif route.group == "mutation" and (replayed := self._replayed(query)):
                    payload = replayed
                else:
                    payload = getattr(self, "_" + route.handler)(route, params, query, parsed, fault)
            status, extra = 200, {}
        except ApiError as e:
            status, payload, extra = e.code, e.body(), e.headers
        except Exception as e:  # an emulator bug: say so rather than drop the connection
            traceback.print_exc()
            error = ApiError(500, "backendError", f"Emulator bug: {e!r}")
            status, payload, extra = 500, error.body(), {}
        entry["status"] = status
        return status, payload, extra

    def _match(self, method, path):
        for route in ROUTES:
            m = route.regex.match(path)
            if m and route.method == method:
                return route, m.groupdict()
        raise ApiError(501, "notImplemented", f"The emulator does not emulate {method} {path}.")

    def _authenticate(self, headers):
        auth = headers.get("Authorization")
        if auth is None:
            if headers.get("x-goog-api-key"):
                raise ApiError(401, "required", "API keys are not supported by this API. Expected OAuth2 access token or other authentication credentials that assert a principal.")
            if self.config["allowAnonymous"]:
                return
            raise ApiError(
                401, "required",
                "Request is missing required authentication credential. Expected OAuth 2 access token, login cookie or other valid authentication credential.",
                headers={"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"'},
            )
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        with self._cond:
            refused = self.config["requireIssuedTokens"] and token not in self._issued and token not in self.config["tokens"]
        if scheme.lower() != "bearer" or not token or refused:
            raise ApiError(
                401, "authError",
                "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential.",
                headers={"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/", error="invalid_token"'},
            )

    # ---- the metadata server -----------------------------------------------

    def _metadata(self, method, path, query, headers):
        """The few metadata-server paths google-cloud-auth's metadata
        credentials read (README.md, "The metadata server"), logged with
        `api` `metadata.<what>`. Plain text or JSON, as the server answers."""
        what = {
            "/computeMetadata/v1/instance/service-accounts/default/token": "token",
            "/computeMetadata/v1/instance/service-accounts/default/email": "email",
            "/computeMetadata/v1/universe/universe-domain": "universe",
        }.get(path.rstrip("/"))
        entry = {
            "seq": next(self._log_seq), "time": time.time(), "method": method, "path": path, "query": query,
            "body": None, "authorization": _auth_kind(headers), "api": f"metadata.{what or 'unknown'}",
            "status": None,
        }
        with self._cond:
            self._log.append(entry)
        # "Requests ... must contain the header Metadata-Flavor: Google";
        # without it the server refuses them (403).
        if headers.get("Metadata-Flavor") != "Google":
            entry["status"] = 403
            return 403, TEXT("Missing required header: Metadata-Flavor"), {}
        if method != "GET" or what is None:
            entry["status"] = 404
            return 404, TEXT("Not Found"), {}
        entry["status"] = 200
        if what == "email":
            return 200, TEXT(METADATA_EMAIL), {}
        if what == "universe":
            return 200, TEXT(METADATA_UNIVERSE), {}
        token = "ya29.emulated-" + secrets.token_urlsafe(16)
        with self._cond:
            self._issued.add(token)
        entry["scopes"] = query.get("scopes")
        return 200, {"access_token": token, "expires_in": METADATA_TOKEN_TTL, "token_type": "Bearer"}, {}

    def _charge(self, group):
        """Counts a request against its group's quota. As the rate-quota page
        describes, a quota refills at the start of each window (synchronized
        intervals, not a sliding one); an exhausted group answers 403
        rateLimitExceeded."""
        quota = self.config["quota"]
        limit = quota[group]
        if not limit:
            return
        window = int(time.time() // quota["window"])
        seen, used = self._quota_used.get(group, (window, 0))
        used = used if seen == window else 0
        if used >= limit:
            metric = "Read requests" if group == "read" else "Queries"
            raise ApiError(
                403, "rateLimitExceeded",
                f"Quota exceeded for quota metric '{metric}' and limit '{metric} per minute' of service 'compute.googleapis.com' for consumer 'project:{self.project}'.",
                domain="usageLimits",
            )
        self._quota_used[group] = (window, used + 1)

    def _check_query(self, route, query):
        for name, value in query.items():
            if name not in route.params and name not in SYSTEM_PARAMS:
                raise ApiError(400, "invalid", f'Invalid JSON payload received. Unknown name "{name}": Cannot bind query parameter. Field \'{name}\' could not be found in request message.')
            if name in ("$alt", "alt") and value != "json":
                raise invalid(name, value, "The emulator answers JSON only.")

    def _take_fault(self, method, path, route):
        for fault in self._faults:
            if fault["api"] not in (None, route.api) or fault["method"] not in (None, method):
                continue
            if fault["path"] is not None and not re.search(fault["path"], path):
                continue
            if fault.get("operationError") and route.group != "mutation":
                continue
            if fault["times"] is not None:
                fault["times"] -= 1
                if fault["times"] <= 0:
                    self._faults.remove(fault)
            fault["hits"] += 1
            return fault
        return None

    # ---- reads -------------------------------------------------------------

    def _get_scoped(self, route, params, query, body, fault):
        collection = route.api.split(".")[0]
        kind, scope = self._scope_of(params)
        self._check_scope(kind, scope)
        resource = self._collection(collection).get((scope, params["name"]))
        if resource is None:
            raise not_found(self._path(kind, scope, collection, params["name"]))
        return _out(resource)

    def _get_subnetwork(self, route, params, query, body, fault):
        self._check_scope("regions", params["region"])
        resource = self.subnetworks.get((params["region"], params["name"]))
        if resource is None:
            raise not_found(self._path("regions", params["region"], "subnetworks", params["name"]))
        return _out(resource)

    def _list_scoped(self, route, params, query, body, fault):
        collection = route.api.split(".")[0]
        kind, scope = self._scope_of(params)
        self._check_scope(kind, scope)
        found = [(k, r) for k, r in self._collection(collection).items() if k[0] == scope]
        page, token = self._page(found, query)
        out = {
            "kind": COLLECTIONS[collection][1] + "List",
            "id": self._path(kind, scope, collection),
            "selfLink": self._link(kind, scope, collection),
        }
        if page:
            out["items"] = [_out(r) for _, r in page]
        if token:
            out["nextPageToken"] = token
        return out

    def _list_aggregated(self, route, params, query, body, fault):
        collection = route.api.split(".")[0]
        kind = COLLECTIONS[collection][0]
        found = [((f"{kind}/{k[0]}", k[1]), r) for k, r in self._collection(collection).items()]
        page, token = self._page(found, query)
        items = {}
        for (scope_key, _), r in page:
            items.setdefault(scope_key, {collection: []})[collection].append(_out(r))
        # Every scope without results on this page is listed with a warning; the
        # regional collections also have a "global" scope (global addresses and
        # forwarding rules, which the emulator does not hold).
        scopes = [f"{kind}/{s}" for s in (self.regions if kind == "regions" else self.zones)]
        for scope_key in scopes + (["global"] if kind == "regions" else []):
            items.setdefault(scope_key, {"warning": {
                "code": "NO_RESULTS_ON_PAGE",
                "message": f"There are no results for scope '{scope_key}' on this page.",
                "data": [{"key": "scope", "value": scope_key}],
            }})
        out = {
            "kind": COLLECTIONS[collection][1] + "AggregatedList",
            "id": self._path("aggregated", collection),
            "items": dict(sorted(items.items())),
            "selfLink": self._link("aggregated", collection),
        }
        if token:
            out["nextPageToken"] = token
        return out

    def _page(self, found, query):
        """Filters, orders and cuts one page of [(sort key, resource)]."""
        text = query.get("filter", "")
        if text.strip():
            try:
                tree = parse_filter(text)
            except FilterError as e:
                raise invalid("filter", text, f"Invalid list filter expression ({e}).") from e
            found = [(k, r) for k, r in found if filter_matches(tree, r)]
        order = query.get("orderBy", "") or "name"
        if order == "name":
            found.sort(key=lambda kr: (kr[1]["name"], kr[0]))
        elif order == "creationTimestamp desc":
            found.sort(key=lambda kr: (kr[1]["creationTimestamp"], kr[1]["name"]), reverse=True)
        else:
            raise invalid("orderBy", order, "Only 'name' and 'creationTimestamp desc' are supported.")
        size = self.config["pageSize"]
        if "maxResults" in query:
            try:
                wanted = int(query["maxResults"])
            except ValueError:
                wanted = -1
            if not 0 <= wanted <= MAX_RESULTS:
                raise invalid("maxResults", query["maxResults"], f"Must be between 0 and {MAX_RESULTS}.")
            size = min(size, wanted or MAX_RESULTS)
        start = 0
        if query.get("pageToken"):
            start = _decode_token(query["pageToken"])
        end = start + size
        return found[start:end], (_encode_token(end) if end < len(found) else None)

    # ---- mutations: forwarding rules ---------------------------------------

    def _address_for(self, region, value):
        """The reserved address a forwarding rule's IPAddress names: an IP, a
        full or partial URL, or a bare name (the forms the reference lists)."""
        if not isinstance(value, str):
            raise invalid("resource.IPAddress", value, "Must be a string.")
        addresses = self.addresses.items()
        try:
            ip = str(ipaddress.ip_address(value))
        except ValueError:
            ip = None
        if ip is not None:
            for (r, _), a in addresses.items():
                if r == region and a["address"] == ip:
                    return a
            raise invalid("resource.IPAddress", value, f"The IP address is not a reserved address of region '{region}' (the emulator assigns no ephemeral addresses).")
        ref = self._parse_ref(value, "addresses", "regions", default_scope=region)
        if ref is None or ref[0] != region:
            raise invalid("resource.IPAddress", value, f"Must be an IP address or an address of region '{region}'.")
        if ref not in addresses:
            raise not_found(self._path("regions", ref[0], "addresses", ref[1]))
        return addresses[ref]

    def _target_in(self, region, value, field="resource.target"):
        """(zone, name) of the target instance a target URL names; it must
        be in a zone of `region` and exist."""
        ref = self._parse_ref(value, "targetInstances", "zones")
        if ref is None:
            raise invalid(field, value, "The emulator emulates target instances only, named by full or partial URL.")
        if self.zones.get(ref[0]) != region:
            raise invalid(field, value, f"The target must be in region '{region}'.")
        if ref not in self.target_instances:
            raise not_found(self._path("zones", ref[0], "targetInstances", ref[1]))
        return ref

    def _forwarding_rule_from(self, region, body, rule_id):
        """Validates an insert's ForwardingRule and returns the resource."""
        name = body.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise invalid("resource.name", name, NAME_RULE)
        scheme = body.get("loadBalancingScheme", "EXTERNAL")
        if scheme != "EXTERNAL" or body.get("backendService"):
            raise invalid("resource.loadBalancingScheme", scheme, "The emulator emulates EXTERNAL protocol forwarding to target instances only.")
        protocol = body.get("IPProtocol", "TCP")
        if protocol not in FORWARDING_PROTOCOLS:
            raise invalid("resource.IPProtocol", protocol, "Protocol forwarding takes TCP, UDP, ESP, AH, SCTP, ICMP or L3_DEFAULT.")
        all_ports = body.get("allPorts") is True
        if protocol == "L3_DEFAULT" and not all_ports:
            # ForwardingRule.allPorts: "The L3_DEFAULT protocol requires allPorts be set to true."
            raise invalid("resource.allPorts", body.get("allPorts", False), "The L3_DEFAULT protocol requires allPorts be set to true.")
        if sum(bool(body.get(k)) for k in ("allPorts", "portRange", "ports")) > 1:
            raise invalid("resource.allPorts", body.get("allPorts"), "The ports, portRange, and allPorts fields are mutually exclusive.")
        if "IPAddress" not in body:
            raise invalid("resource.IPAddress", "", "The emulator assigns no ephemeral addresses: give a reserved address.")
        address = self._address_for(region, body["IPAddress"])
        if address["addressType"] != "EXTERNAL":
            raise invalid("resource.IPAddress", body["IPAddress"], "An EXTERNAL forwarding rule needs an EXTERNAL address.")
        tier = body.get("networkTier", address["networkTier"])
        if tier != address["networkTier"]:
            # ForwardingRule.networkTier: "If IPAddress is specified, this value must be equal to the networkTier of the Address."
            raise invalid("resource.networkTier", tier, f"Must equal the address's network tier {address['networkTier']}.")
        target = self._target_in(region, body.get("target"))
        resource = {
            "kind": "compute#forwardingRule",
            "id": rule_id,
            "name": name,
            "description": body.get("description", ""),
            "region": self._link("regions", region),
            "IPAddress": address["address"],
            "IPProtocol": protocol,
            "target": self._link("zones", target[0], "targetInstances", target[1]),
            "loadBalancingScheme": "EXTERNAL",
            "networkTier": tier,
            "ipVersion": "IPV4",
            "fingerprint": fingerprint(),
            "labels": dict(body.get("labels", {})),
            "labelFingerprint": fingerprint(),
            "selfLink": self._link("regions", region, "forwardingRules", name),
        }
        if all_ports:
            resource["allPorts"] = True
        for k in ("portRange", "ports"):
            if body.get(k):
                resource[k] = body[k]
        return resource

    def _ip_conflict(self, region, ip, protocol=None, skip=None):
        """Whether a DONE forwarding rule (same IPProtocol) or an access config
        already uses `ip` in `region`."""
        for (r, n), rule in self.forwarding_rules.items().items():
            if r == region and (r, n) != skip and rule["IPAddress"] == ip and (protocol is None or rule["IPProtocol"] == protocol):
                return True
        users = self._address_users().get((self._link("regions", region), ip), [])
        return any("/instances/" in u for u in users)

    def _insert_forwarding_rule(self, route, params, query, body, fault):
        region = params["region"]
        self._check_scope("regions", region)
        body = _object(body)
        rule_id = self._new_id()
        resource = self._forwarding_rule_from(region, body, rule_id)
        key = (region, resource["name"])
        if self.forwarding_rules.get(key) is not None or ("forwardingRules", region, resource["name"]) in self._pending:
            raise ApiError(409, "alreadyExists", f"The resource '{self._path('regions', region, 'forwardingRules', resource['name'])}' already exists")

        def apply(t):
            target = self._parse_ref(resource["target"], "targetInstances", "zones")
            if target not in self.target_instances:
                raise OperationFailure("RESOURCE_NOT_FOUND", f"The resource '{self._path('zones', target[0], 'targetInstances', target[1])}' was not found", 404)
            if self._ip_conflict(region, resource["IPAddress"], resource["IPProtocol"]):
                raise OperationFailure("IP_IN_USE_BY_ANOTHER_RESOURCE", f"IP '{resource['IPAddress']}' is already being used by another resource.")
            self.forwarding_rules.put(key, t, dict(resource, creationTimestamp=rfc3339(t)))

        return self._operation(("regions", region), "insert", resource["selfLink"], rule_id, apply, query, fault, ("forwardingRules", region, resource["name"]))

    def _existing_rule(self, params):
        region = params["region"]
        self._check_scope("regions", region)
        key = (region, params["name"])
        rule = self.forwarding_rules.get(key)
        if rule is None:
            raise not_found(self._path("regions", region, "forwardingRules", params["name"]))
        return key, rule

    def _delete_forwarding_rule(self, route, params, query, body, fault):
        key, rule = self._existing_rule(params)

        def apply(t):
            if self.forwarding_rules.get(key) is None:
                raise OperationFailure("RESOURCE_NOT_FOUND", f"The resource '{self._path('regions', key[0], 'forwardingRules', key[1])}' was not found", 404)
            self.forwarding_rules.put(key, t, None)

        return self._operation(("regions", key[0]), "delete", rule["selfLink"], rule["id"], apply, query, fault)

    def _set_target(self, route, params, query, body, fault):
        key, rule = self._existing_rule(params)
        body = _object(body)
        target = self._target_in(key[0], body.get("target"), field="target")
        target_link = self._link("zones", target[0], "targetInstances", target[1])

        def apply(t):
            current = self.forwarding_rules.get(key)
            if current is None:
                raise OperationFailure("RESOURCE_NOT_FOUND", f"The resource '{self._path('regions', key[0], 'forwardingRules', key[1])}' was not found", 404)
            if target not in self.target_instances:
                raise OperationFailure("RESOURCE_NOT_FOUND", f"The resource '{self._path('zones', target[0], 'targetInstances', target[1])}' was not found", 404)
            self.forwarding_rules.put(key, t, dict(current, target=target_link, fingerprint=fingerprint()))

        return self._operation(("regions", key[0]), "setTarget", rule["selfLink"], rule["id"], apply, query, fault)

    # ---- mutations: target instances ---------------------------------------

    def _target_instance_from(self, zone, body, ti_id):
        name = body.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise invalid("resource.name", name, NAME_RULE)
        nat = body.get("natPolicy", "NO_NAT")
        if nat != "NO_NAT":
            raise invalid("resource.natPolicy", nat, "NO_NAT is the only supported value.")
        ref = self._parse_ref(body.get("instance"), "instances", "zones", default_scope=zone)
        if ref is None:
            raise invalid("resource.instance", body.get("instance"), "Must be an instance URL or name.")
        if ref[0] != zone:
            raise invalid("resource.instance", body.get("instance"), f"The instance must be in the target instance's zone '{zone}'.")
        instance = self.instances.get(ref)
        if instance is None:
            raise not_found(self._path("zones", zone, "instances", ref[1]))
        resource = {
            "kind": "compute#targetInstance",
            "id": ti_id,
            "name": name,
            "description": body.get("description", ""),
            "zone": self._link("zones", zone),
            "natPolicy": nat,
            "instance": instance["selfLink"],
            "selfLink": self._link("zones", zone, "targetInstances", name),
        }
        if body.get("network"):
            # TargetInstance.network: the interface on this network receives
            # the traffic (nic0 when it is not given).
            link = self._network_link(body["network"])
            if link is None or link not in {n["network"] for n in instance["networkInterfaces"]}:
                raise invalid("resource.network", body["network"], "Must be the network of one of the instance's interfaces.")
            resource["network"] = link
        return ref, resource

    def _insert_target_instance(self, route, params, query, body, fault):
        zone = params["zone"]
        self._check_scope("zones", zone)
        ti_id = self._new_id()
        ref, resource = self._target_instance_from(zone, _object(body), ti_id)
        key = (zone, resource["name"])
        if key in self.target_instances or ("targetInstances", zone, resource["name"]) in self._pending:
            raise ApiError(409, "alreadyExists", f"The resource '{self._path('zones', zone, 'targetInstances', resource['name'])}' already exists")

        def apply(t):
            if ref not in self.instances:
                raise OperationFailure("RESOURCE_NOT_FOUND", f"The resource '{self._path('zones', zone, 'instances', ref[1])}' was not found", 404)
            self.target_instances[key] = dict(resource, creationTimestamp=rfc3339(t))

        return self._operation(("zones", zone), "insert", resource["selfLink"], ti_id, apply, query, fault, ("targetInstances", zone, resource["name"]))

    def _rules_using(self, ti_link):
        return sorted(r["selfLink"] for r in self.forwarding_rules.items().values() if r["target"] == ti_link)

    def _delete_target_instance(self, route, params, query, body, fault):
        zone = params["zone"]
        self._check_scope("zones", zone)
        key = (zone, params["name"])
        ti = self.target_instances.get(key)
        path = self._path("zones", zone, "targetInstances", params["name"])
        if ti is None:
            raise not_found(path)
        users = self._rules_using(ti["selfLink"])
        if users:
            raise ApiError(400, "resourceInUseByAnotherResource", f"The target_instance resource '{path}' is already being used by '{users[0].removeprefix(LINK)}'")

        def apply(t):
            using = self._rules_using(ti["selfLink"])
            if using:
                raise OperationFailure("RESOURCE_IN_USE_BY_ANOTHER_RESOURCE", f"The target_instance resource '{path}' is already being used by '{using[0].removeprefix(LINK)}'")
            self.target_instances.pop(key, None)

        return self._operation(("zones", zone), "delete", ti["selfLink"], ti["id"], apply, query, fault)

    # ---- mutations: instances ----------------------------------------------

    def _instance_nic(self, params, query):
        zone = params["zone"]
        self._check_scope("zones", zone)
        key = (zone, params["name"])
        inst = self.instances.get(key)
        if inst is None:
            raise not_found(self._path("zones", zone, "instances", params["name"]))
        nic_name = query.get("networkInterface")
        if not nic_name:
            raise ApiError(400, "required", "Required field 'networkInterface' not specified")
        if not any(n["name"] == nic_name for n in inst["networkInterfaces"]):
            raise invalid("networkInterface", nic_name, "The instance has no such network interface.")
        return key, inst, nic_name

    def _nic(self, key, nic_name):
        return next(n for n in self.instances[key]["networkInterfaces"] if n["name"] == nic_name)

    def _access_config(self, body):
        if body.get("type", "ONE_TO_ONE_NAT") != "ONE_TO_ONE_NAT":
            raise invalid("resource.type", body.get("type"), "The emulator emulates ONE_TO_ONE_NAT access configs only.")
        ac = {"kind": "compute#accessConfig", "type": "ONE_TO_ONE_NAT", "name": body.get("name", "External NAT"), "networkTier": body.get("networkTier", "PREMIUM")}
        if body.get("natIP"):
            ac["natIP"] = body["natIP"]
        return ac

    def _add_access_config(self, route, params, query, body, fault):
        key, inst, nic_name = self._instance_nic(params, query)
        region = self.zones[key[0]]
        ac = self._access_config(_object(body))
        if self._nic(key, nic_name)["accessConfigs"]:
            raise ApiError(400, "invalid", "At most one access config currently supported.")
        ip = ac.get("natIP")
        if ip is None:
            raise invalid("resource.natIP", "", "The emulator assigns no ephemeral addresses: give a reserved address.")
        address = next((a for (r, _), a in self.addresses.items().items() if r == region and a["address"] == ip and a["addressType"] == "EXTERNAL"), None)
        if address is None:
            raise invalid("resource.natIP", ip, f"The specified external IP address '{ip}' was not found in region '{region}'.")
        if ac["networkTier"] != address["networkTier"]:
            raise invalid("resource.networkTier", ac["networkTier"], f"Must equal the address's network tier {address['networkTier']}.")

        def apply(t):
            nic = self._nic(key, nic_name)
            if nic["accessConfigs"]:
                raise OperationFailure("INVALID_USAGE", "At most one access config currently supported.")
            if self._ip_conflict(region, ip):
                raise OperationFailure("IP_IN_USE_BY_ANOTHER_RESOURCE", f"IP '{ip}' is already being used by another resource.")
            nic.update(accessConfigs=[ac], fingerprint=fingerprint())

        return self._operation(("zones", key[0]), "addAccessConfig", inst["selfLink"], inst["id"], apply, query, fault)

    def _delete_access_config(self, route, params, query, body, fault):
        key, inst, nic_name = self._instance_nic(params, query)
        name = query.get("accessConfig")
        if not name:
            raise ApiError(400, "required", "Required field 'accessConfig' not specified")
        if not any(ac["name"] == name for ac in self._nic(key, nic_name)["accessConfigs"]):
            raise invalid("accessConfig", name, f"The network interface '{nic_name}' has no such access config.")

        def apply(t):
            nic = self._nic(key, nic_name)
            kept = [ac for ac in nic["accessConfigs"] if ac["name"] != name]
            if len(kept) == len(nic["accessConfigs"]):
                raise OperationFailure("RESOURCE_NOT_FOUND", f"The access config '{name}' was not found", 404)
            nic.update(accessConfigs=kept, fingerprint=fingerprint())

        return self._operation(("zones", key[0]), "deleteAccessConfig", inst["selfLink"], inst["id"], apply, query, fault)

    def _alias_range(self, spec, subnet, nic_name):
        """A validated aliasIpRanges entry and its network."""
        field = "resource.aliasIpRanges.ipCidrRange"
        text = spec.get("ipCidrRange", "")
        try:
            net = ipaddress.ip_network(text if "/" in text else text + "/32")
        except ValueError:
            raise invalid(field, text, "Must be an IP address or CIDR range (the emulator allocates none).") from None
        range_name = spec.get("subnetworkRangeName")
        if range_name:
            ranges = {r["rangeName"]: r["ipCidrRange"] for r in subnet["secondaryIpRanges"]}
            if range_name not in ranges:
                raise invalid("resource.aliasIpRanges.subnetworkRangeName", range_name, f"The subnetwork of '{nic_name}' has no such secondary range.")
            within = ranges[range_name]
        else:
            within = subnet["ipCidrRange"]
        if not net.subnet_of(ipaddress.ip_network(within)):
            raise invalid(field, text, f"Must be within {within}.")
        entry = {"ipCidrRange": str(net)}
        if range_name:
            entry["subnetworkRangeName"] = range_name
        return entry, net

    def _update_network_interface(self, route, params, query, body, fault):
        key, inst, nic_name = self._instance_nic(params, query)
        nic = self._nic(key, nic_name)
        body = _object(body)
        sent = body.get("fingerprint")
        if not sent:
            raise invalid("resource.fingerprint", "", "The interface's current fingerprint is required.")
        sent_bytes = decode_fingerprint(sent)
        if sent_bytes is None:
            raise invalid("resource.fingerprint", sent, "Must be base64.")
        if sent_bytes != decode_fingerprint(nic["fingerprint"]):
            raise ApiError(412, "conditionNotMet", "Supplied fingerprint does not match current network interface fingerprint.")
        # A client may send back the interface it read: unchanged fields are
        # fine, changing the network (migrating the VM) is not emulated.
        for field in ("network", "subnetwork", "networkIP"):
            same = body.get(field) == nic[field] or (
                field != "networkIP" and isinstance(body.get(field), str) and self._relative(body[field]) == self._relative(nic[field]))
            if field in body and not same:
                raise invalid(f"resource.{field}", body[field], "The emulator changes only aliasIpRanges (moving an interface is not emulated).")
        if body.get("name", nic_name) != nic_name:
            raise invalid("resource.name", body["name"], f"Must be '{nic_name}'.")
        # PATCH semantics: an absent aliasIpRanges leaves them as they are.
        if "aliasIpRanges" not in body:
            aliases = None
        else:
            subnet_key = self._parse_ref(nic["subnetwork"], "subnetworks", "regions")
            subnet = self.subnetworks[subnet_key]
            checked = [self._alias_range(r, subnet, nic_name) for r in body["aliasIpRanges"]]
            for i, (_, a) in enumerate(checked):
                if any(a.overlaps(b) for _, b in checked[:i]):
                    raise invalid("resource.aliasIpRanges", str(a), "Alias IP ranges overlap.")
            aliases = [entry for entry, _ in checked]

        def apply(t):
            current = self._nic(key, nic_name)
            if decode_fingerprint(current["fingerprint"]) != sent_bytes:
                raise OperationFailure("CONDITION_NOT_MET", "Supplied fingerprint does not match current network interface fingerprint.", 412)
            if aliases is not None:
                for entry in aliases:
                    net = ipaddress.ip_network(entry["ipCidrRange"])
                    holder = self._ip_holder(net, skip=(key, nic_name))
                    if holder:
                        raise OperationFailure("IP_IN_USE_BY_ANOTHER_RESOURCE", f"IP range '{net}' is already being used by '{holder}'.")
                current["aliasIpRanges"] = aliases
            current["fingerprint"] = fingerprint()

        return self._operation(("zones", key[0]), "updateNetworkInterface", inst["selfLink"], inst["id"], apply, query, fault)

    def _ip_holder(self, net, skip):
        """The instance whose interface (primary IP or alias range) overlaps `net`."""
        for key, inst in self.instances.items():
            for nic in inst["networkInterfaces"]:
                if (key, nic["name"]) == skip:
                    continue
                held = [ipaddress.ip_network(nic["networkIP"] + "/32")]
                held += [ipaddress.ip_network(r["ipCidrRange"]) for r in nic["aliasIpRanges"]]
                if any(net.overlaps(h) for h in held):
                    return inst["selfLink"].removeprefix(LINK)
        return None

    # ---- operations API ----------------------------------------------------

    def _get_operation(self, route, params, query, body, fault):
        return self._render_operation(self._find_operation(params))

    def _wait_operation(self, params):
        """operations.wait: returns when the operation is DONE or when the
        deadline passes (`waitCap`, two minutes as in the reference), whichever
        is first; called under the lock, which cond.wait releases."""
        op = self._find_operation(params)
        deadline = time.time() + self.config["waitCap"]
        while not op["done"]:
            left = deadline - time.time()
            if left <= 0:
                break
            self._cond.wait(timeout=max(0.0, min(left, op["due"] - time.time())) + 0.001)
            self._tick()
        return self._render_operation(op)

    # ---- control API -------------------------------------------------------

    def _control(self, method, path, query_text, body):
        query = {k: v[-1] for k, v in parse_qs(query_text).items()}
        try:
            data = json.loads(body) if body.strip() else None
        except ValueError:
            return 400, {"error": "the body is not JSON"}, {}
        try:
            with self._cond:
                self._tick()
                return 200, self._control_locked(method, path.removeprefix("/_emulator/"), query, data), {}
        except (ControlError, ValueError, re.error) as e:
            return 400, {"error": str(e)}, {}

    def _control_locked(self, method, what, query, data):
        if (method, what) == ("GET", "health"):
            return {"ok": True, "project": self.project}
        if (method, what) == ("POST", "reset"):
            self.reset(data)
            return {"ok": True, "project": self.project}
        if (method, what) == ("POST", "seed"):
            if isinstance(data, dict) and data.get("project", self.project) != self.project:
                raise ControlError("the project is set by a reset, not a seed")
            self._apply_seed(data, time.time())
            return {"ok": True}
        if (method, what) == ("GET", "state"):
            return self._state()
        if what == "config":
            if method == "POST":
                self._set_config(data)
            return copy.deepcopy(self.config)
        if what == "faults":
            if method == "POST":
                return self._arm_fault(data)
            if method == "DELETE":
                self._faults.clear()
            return [dict(f) for f in self._faults]
        if what == "requests":
            if method == "DELETE":
                self._log.clear()
                return []
            since = int(query.get("since", 0))
            return [dict(e) for e in self._log if e["seq"] >= since]
        if (method, what) == ("GET", "routing"):
            return self.routing()
        if (method, what) == ("POST", "labels"):
            return self._set_labels(data)
        raise ControlError(f"no control call {method} /_emulator/{what}")

    def _set_labels(self, data):
        """Replaces a reserved address's labels, as an operator's
        `addresses.setLabels` would (the provider never calls it, so it is a
        control call, not an emulated one): committed at once, with a new
        `labelFingerprint`; stale reads see it `staleness` later."""
        if not isinstance(data, dict) or not isinstance(data.get("labels"), dict):
            raise ControlError("labels takes {region, name, labels}")
        found = (data.get("region"), data.get("name"))
        if self.addresses.get(found) is None:
            raise ControlError(f"no address {data.get('name')!r} in region {data.get('region')!r}")
        updated = dict(self.addresses.get(found), labels=dict(data["labels"]), labelFingerprint=fingerprint())
        self.addresses.put(found, time.time(), updated)
        return _out(updated)

    def _state(self):
        ops = sorted(self._ops.values(), key=lambda o: o["resource"]["insertTime"])
        return {
            "project": self.project,
            "regions": copy.deepcopy(self.regions),
            "networks": sorted(self.networks),
            "subnetworks": [_out(r) for _, r in sorted(self.subnetworks.items())],
            "instances": [_out(r) for _, r in sorted(self.instances.items())],
            "addresses": [_out(r) for _, r in sorted(self.addresses.items().items())],
            "targetInstances": [_out(r) for _, r in sorted(self.target_instances.items())],
            "forwardingRules": [_out(r) for _, r in sorted(self.forwarding_rules.items().items())],
            "operations": [self._render_operation(o) for o in ops],
        }

    def _set_config(self, data):
        if not isinstance(data, dict):
            raise ControlError("config is a JSON object")
        for k, v in data.items():
            if k not in DEFAULT_CONFIG:
                raise ControlError(f"unknown config key {k!r}")
            if k == "quota":
                if not isinstance(v, dict) or set(v) - set(DEFAULT_CONFIG["quota"]):
                    raise ControlError("quota takes read, mutation and window")
                merged = dict(self.config["quota"], **v)
                if not all(isinstance(x, (int, float)) and x >= 0 for x in merged.values()) or merged["window"] <= 0:
                    raise ControlError("quota values are non-negative numbers, window positive")
                self.config["quota"] = merged
            elif k in ("allowAnonymous", "requireIssuedTokens"):
                if not isinstance(v, bool):
                    raise ControlError(f"{k} is a boolean")
                self.config[k] = v
            elif k == "tokens":
                if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
                    raise ControlError("tokens is a list of strings")
                self.config[k] = list(v)
            else:
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                    raise ControlError(f"{k} is a non-negative number")
                if k == "pageSize" and not 1 <= v <= MAX_RESULTS:
                    raise ControlError(f"pageSize is between 1 and {MAX_RESULTS}")
                self.config[k] = int(v) if k == "pageSize" else float(v)

    def _arm_fault(self, data):
        if not isinstance(data, dict):
            raise ControlError("a fault is a JSON object")
        known = {"api", "method", "path", "times", "status", "reason", "message", "domain", "stall", "operationError"}
        if set(data) - known:
            raise ControlError(f"unknown fault keys {sorted(set(data) - known)}")
        if not any(data.get(k) for k in ("status", "stall", "operationError")):
            raise ControlError("a fault needs status, stall or operationError")
        if data.get("api") and not any(r.api == data["api"] for r in ROUTES):
            raise ControlError(f"no emulated call {data['api']!r}")
        if data.get("path"):
            re.compile(data["path"])
        times = data.get("times", 1)
        if times is not None and not (isinstance(times, int) and times > 0):
            raise ControlError("times is a positive count, or null for every request")
        status = data.get("status")
        if status is not None and not (isinstance(status, int) and 400 <= status <= 599):
            raise ControlError("status is an HTTP error code")
        opfail = data.get("operationError")
        if opfail is not None:
            if not isinstance(opfail, dict) or not opfail.get("code"):
                raise ControlError("operationError is {code, message, httpStatus}")
            opfail = {"code": opfail["code"], "message": opfail.get("message", opfail["code"]), "httpStatus": int(opfail.get("httpStatus", 400))}
        reason = data.get("reason") or FAULT_REASONS.get(status, "backendError")
        fault = {
            "id": next(self._fault_ids),
            "api": data.get("api"),
            "method": data.get("method"),
            "path": data.get("path"),
            "times": times,
            "status": status,
            "reason": reason,
            "domain": data.get("domain") or ("usageLimits" if reason == "rateLimitExceeded" else "global"),
            "message": data.get("message") or f"Injected fault ({reason}).",
            "stall": float(data.get("stall") or 0),
            "operationError": opfail,
            "hits": 0,
        }
        self._faults.append(fault)
        return dict(fault)


def _seeded_at(history, key, t):
    """When a seeded version counts as committed: a resource a seed creates
    has always been there (stale reads see it too); a seed's change to an
    existing one is a change at `t`, which stale reads see late."""
    return t if history.get(key) is not None else 0.0


def _out(resource):
    """A resource as Compute answers it: a copy without empty strings, lists
    and maps (proto3 JSON omits fields at their defaults)."""
    if isinstance(resource, dict):
        return {k: _out(v) for k, v in resource.items() if v not in ("", [], {}, None)}
    if isinstance(resource, list):
        return [_out(v) for v in resource]
    return resource


def _object(body):
    if not isinstance(body, dict):
        raise ApiError(400, "invalid", "The request body must be a JSON object.")
    return body


def _parse_body(body):
    # The client sends `null` as the body of a POST with no request message
    # (wait, deleteAccessConfig): gaxi's handle_empty() gives them NoBody.
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except ValueError as e:
        raise ApiError(400, "parseError", f"Invalid JSON payload received. {e}") from e


def _logged_body(body):
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


def _auth_kind(headers):
    auth = headers.get("Authorization")
    if auth is None:
        return None
    return "bearer" if auth.lower().startswith("bearer ") else "other"


def _encode_token(offset):
    return base64.urlsafe_b64encode(json.dumps({"offset": offset}).encode()).decode()


def _decode_token(token):
    try:
        offset = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))["offset"]
        if isinstance(offset, int) and offset >= 0:
            return offset
    except (ValueError, KeyError, TypeError):
        pass
    raise invalid("pageToken", token, "Not a page token of this list.")


# ------------------------------------------------------------------ server ---


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client's reqwest pool reuses connections
    server_version = "egret-gcp-emulator"

    def _serve(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        status, payload, extra = self.server.emulator.handle(self.command, self.path, self.headers, body)
        text = isinstance(payload, TEXT)
        data = payload.encode() if text else json.dumps(payload).encode()
        self.send_response(status)
        if text:
            self.send_header("Content-Type", "application/text")
            self.send_header("Metadata-Flavor", "Google")
        else:
            self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve

    def log_message(self, format, *args):
        if not self.server.quiet:
            super().log_message(format, *args)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # a lab's gateways connect at once

    def __init__(self, emulator, address="127.0.0.1", port=0, tls_dir=None, quiet=False):
        self.address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        super().__init__((address, port), _Handler)
        self.emulator, self.quiet = emulator, quiet
        if tls_dir:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(os.path.join(tls_dir, "server.pem"), os.path.join(tls_dir, "server.key"))
            # The handshake happens on the handler's thread (first read), so a
            # slow client does not hold up accept().
            self.socket = ctx.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request, client_address):
        # One line, not socketserver's traceback: clients that reject the
        # certificate or hang up during a stall are part of the tests.
        if not self.quiet:
            print(f"gcp-emulator: {client_address[0]}: {sys.exc_info()[1]!r}", file=sys.stderr)

    @property
    def port(self):
        return self.server_address[1]


def main(argv=None):
    p = argparse.ArgumentParser(description="Compute Engine emulator for Egret's tests (not Google Cloud).")
    p.add_argument("--address", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: any free one, see --port-file)")
    p.add_argument("--port-file", help="write the port here once listening")
    p.add_argument("--tls-dir", help="serve HTTPS with DIR/server.pem and DIR/server.key")
    p.add_argument("--state-dir", help="the lifecycle script's state directory (names the process)")
    p.add_argument("--operation-delay", type=float, help="seconds until an operation is DONE (default 0.2)")
    p.add_argument("--staleness", type=float, help="seconds address and forwarding-rule reads lag (default 0)")
    p.add_argument("--page-size", type=int, help="most items per list page (default 500)")
    p.add_argument("--allow-anonymous", action="store_true", help="answer requests without Authorization")
    p.add_argument("--seed", help="JSON file to seed from instead of the default lab")
    p.add_argument("--quiet", action="store_true", help="do not log each request to stderr")
    a = p.parse_args(argv)
    config = {k: v for k, v in (
        ("operationDelay", a.operation_delay), ("staleness", a.staleness), ("pageSize", a.page_size),
        ("allowAnonymous", a.allow_anonymous or None)) if v is not None}
    emulator = Emulator(config)
    if a.seed:
        with open(a.seed) as f:
            emulator.reset(json.load(f))
    server = Server(emulator, a.address, a.port, a.tls_dir, a.quiet)
    if a.port_file:
        tmp = a.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{server.port}\n")
        os.replace(tmp, a.port_file)
    print(f"gcp-emulator: listening on {a.address}:{server.port}{' (TLS)' if a.tls_dir else ''}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
