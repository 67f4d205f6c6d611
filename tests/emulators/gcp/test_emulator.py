#!/usr/bin/env python3
"""Self-test of the Compute Engine emulator: the contract the Rust client
(google-cloud-compute-v1) and Egret's GCP provider rely on.

Runs the emulator in-process on 127.0.0.1 (one server, reset before each test)
and talks to it over HTTP the way the client does: `$alt=json` and
`$apiVersion` on every call, form-encoded query values, `null` as the body of
a POST without a request message, a Bearer token.

    python3 tests/emulators/gcp/test_emulator.py
"""

import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gcp_emulator  # noqa: E402

P = "/compute/v1/projects/egret-lab/"
REGION = "us-central1"
ZONE_A, ZONE_B = "us-central1-a", "us-central1-b"
API_VERSION = "2026-09-01"  # what google-cloud-compute-v1 4.1.0 sends


def test_seed():
    """The default lab, plus a fifth address, a second region with an
    instance and a target instance, and a second instance in zone a."""
    seed = gcp_emulator.default_seed()
    seed["regions"]["europe-west1"] = ["europe-west1-b"]
    seed["subnetworks"].append({"name": "eu", "region": "europe-west1", "network": "lab", "ipCidrRange": "198.19.1.0/24"})
    seed["instances"] += [
        {"name": "gw-eu", "zone": "europe-west1-b", "networkInterfaces": [{"subnetwork": "eu", "networkIP": "198.19.1.10"}]},
        {"name": "gw-c", "zone": ZONE_A, "networkInterfaces": [{"subnetwork": "gateways", "networkIP": "198.18.1.12"}]},
    ]
    seed["addresses"].append({"name": "egress-3", "region": REGION, "address": "203.0.113.12", "labels": {"egret-pool": "lab", "tier": "a"}})
    seed["targetInstances"] = [{"name": "ti-eu", "zone": "europe-west1-b", "instance": "gw-eu"}]
    return seed


CONFIG = {
    "operationDelay": 0.05,
    "staleness": 0.0,
    "pageSize": 500,
    "allowAnonymous": False,
    "waitCap": 120.0,
    "quota": {"read": 0, "mutation": 0, "window": 60.0},
    "requireIssuedTokens": False,
    "tokens": [],
}


class EmulatorTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.emulator = gcp_emulator.Emulator()
        cls.server = gcp_emulator.Server(cls.emulator, quiet=True)
        cls.base = f"http://127.0.0.1:{cls.server.port}"
        threading.Thread(target=cls.server.serve_forever, daemon=True).start()

    @classmethod
    def tearDownClass(cls):
        cls.server.shutdown()
        cls.server.server_close()

    def setUp(self):
        self.ctl("POST", "config", CONFIG)
        self.ctl("POST", "reset", test_seed())

    # ---- helpers ------------------------------------------------------------

    def api(self, method, path, query=(), body=None, headers=None, system=True):
        params = list(query) + ([("$alt", "json"), ("$apiVersion", API_VERSION)] if system else [("$alt", "json")])
        data = json.dumps(body).encode() if body is not None else (b"null" if method in ("POST", "PUT") else None)
        hdrs = {"Authorization": "Bearer test-token", "x-goog-api-client": "gl-rust/test", "Content-Type": "application/json"}
        hdrs.update(headers or {})
        hdrs = {k: v for k, v in hdrs.items() if v is not None}
        req = urllib.request.Request(self.base + path + "?" + urllib.parse.urlencode(params), data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            self.last_headers = e.headers
            return e.code, json.load(e)

    def ok(self, method, path, query=(), body=None):
        status, out = self.api(method, path, query, body)
        self.assertEqual(status, 200, out)
        return out

    def ctl(self, method, what, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.base}/_emulator/{what}", data=data, method=method)
        with urllib.request.urlopen(req) as r:
            return json.load(r)

    def op_path(self, op):
        return "/compute/v1/" + op["selfLink"].removeprefix(gcp_emulator.LINK)

    def wait(self, op):
        """operations.wait (the client's poller uses operations.get, which
        the operation tests check too)."""
        done = self.ok("POST", self.op_path(op) + "/wait")
        self.assertEqual(done["status"], "DONE", done)
        return done

    def insert_target(self, name, zone, instance):
        return self.wait(self.ok("POST", P + f"zones/{zone}/targetInstances", body={"name": name, "instance": instance}))

    def insert_rule(self, name, ip, target, wait=True, **extra):
        body = {"name": name, "IPAddress": ip, "IPProtocol": "L3_DEFAULT", "allPorts": True, "loadBalancingScheme": "EXTERNAL", "target": target, **extra}
        op = self.ok("POST", P + f"regions/{REGION}/forwardingRules", body=body)
        return self.wait(op) if wait else op

    def route_of(self, name):
        entry = next(a for a in self.ctl("GET", "routing")["addresses"] if a["name"] == name)
        return entry["instance"]["name"] if entry["instance"] else None

    def assert_error(self, status, out, code, reason, state):
        self.assertEqual(status, code, out)
        err = out["error"]
        self.assertEqual(err["code"], code)
        self.assertEqual(err["status"], state)
        self.assertEqual(err["errors"][0]["reason"], reason)
        self.assertEqual(err["errors"][0]["message"], err["message"])
        return err

    def ti_link(self, zone, name):
        return f"{gcp_emulator.LINK}projects/egret-lab/zones/{zone}/targetInstances/{name}"

    # ---- labels and filters --------------------------------------------------

    def names(self, out, member="items"):
        return sorted(a["name"] for a in out.get(member, []))

    def test_label_filters_select_exactly_the_labelled_addresses(self):
        path = P + f"regions/{REGION}/addresses"
        cases = {
            'labels.egret-pool="lab"': ["egress-1", "egress-2", "egress-3"],
            "labels.egret-pool=lab": ["egress-1", "egress-2", "egress-3"],
            'labels.egret-pool = "other"': ["egress-other"],
            '(labels.egret-pool = "lab") (labels.tier = "a")': ["egress-3"],
            'labels.egret-pool="lab" AND labels.tier="a"': ["egress-3"],
            'labels.egret-pool="lab" labels.tier="a"': ["egress-3"],
            "labels.egret-pool:*": ["egress-1", "egress-2", "egress-3", "egress-other"],
            "labels.egret-pool:la": ["egress-1", "egress-2", "egress-3"],
            'labels.egret-pool != "lab"': ["egress-other", "unlabelled"],
            'address = "203.0.113.11"': ["egress-2"],
            'status = RESERVED labels.tier = a': ["egress-3"],
        }
        for text, want in cases.items():
            with self.subTest(filter=text):
                self.assertEqual(self.names(self.ok("GET", path, [("filter", text)])), want)
        out = self.ok("GET", P + "aggregated/addresses", [("filter", 'labels.egret-pool="lab"')])
        self.assertEqual(self.names(out["items"][f"regions/{REGION}"], "addresses"), ["egress-1", "egress-2", "egress-3"])
        self.assertEqual(out["items"]["regions/europe-west1"]["warning"]["code"], "NO_RESULTS_ON_PAGE")
        self.assertEqual(out["items"]["global"]["warning"]["data"], [{"key": "scope", "value": "global"}])

    def test_filters_outside_the_emulated_subset_are_rejected(self):
        for text in [
            'labels.a="b" OR labels.c="d"',  # OR: not emulated
            "name eq egress-1",  # the regular-expression form
            'labels.a > "b"',
            '(labels.a="b"',
            'labels.a="b',
            "labels.a='b'",
            "-labels.a:*",
            "labels.a = *",
        ]:
            with self.subTest(filter=text):
                status, out = self.api("GET", P + f"regions/{REGION}/addresses", [("filter", text)])
                err = self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")
                self.assertTrue(err["message"].startswith(f"Invalid value for field 'filter': '{text}'."), err)

    # ---- forwarding rules, operations, routing -------------------------------

    def test_insert_then_set_target_moves_the_routing_truth_only_when_done(self):
        self.insert_target("ti-a", ZONE_A, "gw-a")
        self.insert_target("ti-b", ZONE_B, f"zones/{ZONE_B}/instances/gw-b")
        self.ctl("POST", "config", {"operationDelay": 0.4})
        address = f"{gcp_emulator.LINK}projects/egret-lab/regions/{REGION}/addresses/egress-1"
        op = self.insert_rule("egret-egress-1", address, self.ti_link(ZONE_A, "ti-a"), wait=False)
        self.assertEqual((op["status"], op["operationType"]), ("PENDING", "insert"))
        self.assertIsNone(self.route_of("egress-1"))
        self.assertEqual(self.ok("GET", P + f"regions/{REGION}/addresses/egress-1")["status"], "RESERVED")
        time.sleep(0.25)
        self.assertEqual(self.ok("GET", self.op_path(op))["status"], "RUNNING")
        self.assertIsNone(self.route_of("egress-1"))
        self.wait(op)
        self.assertEqual(self.route_of("egress-1"), "gw-a")
        routing = next(a for a in self.ctl("GET", "routing")["addresses"] if a["name"] == "egress-1")
        self.assertEqual(routing["instance"]["networkIP"], "198.18.1.10")
        self.assertEqual(routing["routes"][0]["IPProtocol"], "L3_DEFAULT")
        rule = self.ok("GET", P + f"regions/{REGION}/forwardingRules/egret-egress-1")
        self.assertEqual((rule["IPAddress"], rule["target"], rule["allPorts"]), ("203.0.113.10", self.ti_link(ZONE_A, "ti-a"), True))
        addr = self.ok("GET", P + f"regions/{REGION}/addresses/egress-1")
        self.assertEqual((addr["status"], addr["users"]), ("IN_USE", [rule["selfLink"]]))

        move = self.ok("POST", P + f"regions/{REGION}/forwardingRules/egret-egress-1/setTarget", body={"target": self.ti_link(ZONE_B, "ti-b")})
        self.assertEqual((move["operationType"], move["targetLink"]), ("setTarget", rule["selfLink"]))
        self.assertEqual(self.route_of("egress-1"), "gw-a")
        self.wait(move)
        self.assertEqual(self.route_of("egress-1"), "gw-b")
        self.assertEqual(self.ok("GET", P + f"regions/{REGION}/forwardingRules/egret-egress-1")["target"], self.ti_link(ZONE_B, "ti-b"))

    def test_operations_get_wait_and_their_scopes(self):
        self.ctl("POST", "config", {"operationDelay": 0.3})
        op = self.ok("POST", P + f"zones/{ZONE_A}/targetInstances", body={"name": "ti-a", "instance": "gw-a"})
        for key in ("kind", "id", "name", "selfLink", "zone", "targetLink", "targetId", "insertTime", "user"):
            self.assertIn(key, op)
        self.assertEqual(op["kind"], "compute#operation")
        self.assertTrue(op["selfLink"].endswith(f"/zones/{ZONE_A}/operations/{op['name']}"))
        # The client's poller asks zoneOperations.get without $apiVersion.
        status, got = self.api("GET", self.op_path(op), system=False)
        self.assertEqual(status, 200, got)
        self.assertIn(got["status"], ("PENDING", "RUNNING"))
        self.assertNotIn("endTime", got)
        status, out = self.api("GET", P + f"regions/{REGION}/operations/{op['name']}")
        self.assert_error(status, out, 404, "notFound", "NOT_FOUND")
        status, out = self.api("GET", P + f"global/operations/{op['name']}")
        self.assert_error(status, out, 404, "notFound", "NOT_FOUND")
        start = time.time()
        done = self.wait(op)
        self.assertLess(time.time() - start, 0.5)
        self.assertEqual((done["progress"], done["targetLink"]), (100, self.ti_link(ZONE_A, "ti-a")))
        self.assertLessEqual(done["insertTime"], done["startTime"])
        self.assertLessEqual(done["startTime"], done["endTime"])
        self.assertNotIn("error", done)

        # wait returns at its deadline with the operation still running.
        self.ctl("POST", "config", {"operationDelay": 5.0, "waitCap": 0.2})
        slow = self.ok("POST", P + f"zones/{ZONE_B}/targetInstances", body={"name": "ti-b", "instance": "gw-b"})
        start = time.time()
        waited = self.ok("POST", self.op_path(slow) + "/wait")
        self.assertGreaterEqual(time.time() - start, 0.2)
        self.assertLess(time.time() - start, 1.0)
        self.assertIn(waited["status"], ("PENDING", "RUNNING"))

    def test_operation_delay_zero_answers_done(self):
        self.ctl("POST", "config", {"operationDelay": 0})
        op = self.ok("POST", P + f"zones/{ZONE_A}/targetInstances", body={"name": "ti-a", "instance": "gw-a"})
        self.assertEqual(op["status"], "DONE")
        self.assertEqual(self.ok("GET", P + f"zones/{ZONE_A}/targetInstances/ti-a")["instance"].rsplit("/", 1)[1], "gw-a")

    def test_forwarding_rule_validation(self):
        self.insert_target("ti-a", ZONE_A, "gw-a")
        ti = self.ti_link(ZONE_A, "ti-a")
        path = P + f"regions/{REGION}/forwardingRules"
        status, out = self.api("POST", path, body={"name": "r1", "IPAddress": "203.0.113.10", "IPProtocol": "L3_DEFAULT", "target": ti})
        err = self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")
        self.assertIn("'resource.allPorts'", err["message"])
        status, out = self.api("POST", path, body={"name": "Bad_Name", "IPAddress": "203.0.113.10", "target": ti})
        self.assertIn("'resource.name'", self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"])
        status, out = self.api("POST", path, body={"name": "r1", "IPAddress": "192.0.2.1", "target": ti})
        self.assertIn("'resource.IPAddress'", self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"])
        status, out = self.api("POST", path, body={"name": "r1", "IPAddress": "203.0.113.10", "networkTier": "STANDARD", "target": ti})
        self.assertIn("'resource.networkTier'", self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"])
        status, out = self.api("POST", path, body={"name": "r1", "IPAddress": "203.0.113.10", "target": self.ti_link("europe-west1-b", "ti-eu")})
        self.assertIn("'resource.target'", self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"])
        status, out = self.api("POST", path, body={"name": "r1", "IPAddress": "203.0.113.10", "target": self.ti_link(ZONE_B, "missing")})
        err = self.assert_error(status, out, 404, "notFound", "NOT_FOUND")
        self.assertEqual(err["message"], f"The resource 'projects/egret-lab/zones/{ZONE_B}/targetInstances/missing' was not found")
        # IPAddress by bare name and by partial URL resolve to the address.
        self.insert_rule("by-name", "egress-2", ti)
        self.insert_rule("by-partial", f"projects/egret-lab/regions/{REGION}/addresses/egress-3", ti)
        rules = self.ok("GET", path)["items"]
        self.assertEqual({r["name"]: r["IPAddress"] for r in rules}, {"by-name": "203.0.113.11", "by-partial": "203.0.113.12"})
        status, out = self.api("POST", path, body={"name": "by-name", "IPAddress": "egress-1", "IPProtocol": "L3_DEFAULT", "allPorts": True, "target": ti})
        err = self.assert_error(status, out, 409, "alreadyExists", "ALREADY_EXISTS")
        self.assertEqual(err["message"], f"The resource 'projects/egret-lab/regions/{REGION}/forwardingRules/by-name' already exists")
        # A second L3_DEFAULT rule for an address in use fails in its operation.
        second = self.insert_rule("again", "egress-2", ti, wait=False)
        done = self.ok("POST", self.op_path(second) + "/wait")
        self.assertEqual(done["status"], "DONE")
        self.assertEqual(done["error"]["errors"][0]["code"], "IP_IN_USE_BY_ANOTHER_RESOURCE")
        self.assertEqual((done["httpErrorStatusCode"], done["httpErrorMessage"]), (400, "BAD REQUEST"))
        self.assert_error(*self.api("GET", path + "/again"), 404, "notFound", "NOT_FOUND")

    def test_target_instance_rules(self):
        status, out = self.api("POST", P + f"zones/{ZONE_A}/targetInstances", body={"name": "x", "instance": f"zones/{ZONE_B}/instances/gw-b"})
        self.assertIn("'resource.instance'", self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"])
        status, out = self.api("POST", P + f"zones/{ZONE_A}/targetInstances", body={"name": "x", "instance": "gw-a", "natPolicy": "NAT"})
        self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")
        self.insert_target("ti-a", ZONE_A, "gw-a")
        status, out = self.api("POST", P + f"zones/{ZONE_A}/targetInstances", body={"name": "ti-a", "instance": "gw-a"})
        self.assert_error(status, out, 409, "alreadyExists", "ALREADY_EXISTS")
        self.insert_rule("r1", "egress-1", self.ti_link(ZONE_A, "ti-a"))
        status, out = self.api("DELETE", P + f"zones/{ZONE_A}/targetInstances/ti-a")
        err = self.assert_error(status, out, 400, "resourceInUseByAnotherResource", "INVALID_ARGUMENT")
        self.assertIn(f"regions/{REGION}/forwardingRules/r1", err["message"])
        self.wait(self.ok("DELETE", P + f"regions/{REGION}/forwardingRules/r1"))
        self.assertIsNone(self.route_of("egress-1"))
        self.assertEqual(self.ok("GET", P + f"regions/{REGION}/addresses/egress-1")["status"], "RESERVED")
        self.wait(self.ok("DELETE", P + f"zones/{ZONE_A}/targetInstances/ti-a"))
        self.assert_error(*self.api("GET", P + f"zones/{ZONE_A}/targetInstances/ti-a"), 404, "notFound", "NOT_FOUND")
        # TargetInstance.network must be one of the instance's networks.
        status, out = self.api("POST", P + f"zones/{ZONE_A}/targetInstances", body={"name": "ti-c", "instance": "gw-c", "network": "global/networks/elsewhere"})
        self.assertIn("'resource.network'", self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"])
        self.wait(self.ok("POST", P + f"zones/{ZONE_A}/targetInstances", body={"name": "ti-c", "instance": "gw-c", "network": "global/networks/lab"}))
        listed = self.ok("GET", P + f"zones/{ZONE_A}/targetInstances")
        self.assertEqual([t["name"] for t in listed["items"]], ["ti-c"])
        self.assertEqual(listed["items"][0]["natPolicy"], "NO_NAT")

    def test_request_id_replays_the_operation(self):
        self.insert_target("ti-a", ZONE_A, "gw-a")
        rid = "7a1c6f0e-2b9e-4d7c-9a51-0c2f4b8e9d13"
        body = {"name": "r1", "IPAddress": "egress-1", "IPProtocol": "L3_DEFAULT", "allPorts": True, "target": self.ti_link(ZONE_A, "ti-a")}
        first = self.ok("POST", P + f"regions/{REGION}/forwardingRules", [("requestId", rid)], body)
        self.wait(first)
        again = self.ok("POST", P + f"regions/{REGION}/forwardingRules", [("requestId", rid)], body)
        self.assertEqual((again["name"], again["status"]), (first["name"], "DONE"))
        self.assertEqual(len(self.ok("GET", P + f"regions/{REGION}/forwardingRules")["items"]), 1)
        status, out = self.api("POST", P + f"regions/{REGION}/forwardingRules", [("requestId", "00000000-0000-0000-0000-000000000000")], body)
        self.assertIn("'requestId'", self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"])

    # ---- pagination -----------------------------------------------------------

    def test_pagination(self):
        self.ctl("POST", "config", {"pageSize": 2})
        path = P + f"regions/{REGION}/addresses"
        names, token, pages = [], None, 0
        while True:
            out = self.ok("GET", path, [("pageToken", token)] if token else [])
            pages += 1
            names += [a["name"] for a in out["items"]]
            token = out.get("nextPageToken")
            if not token:
                break
        self.assertEqual(pages, 3)
        self.assertEqual(names, ["egress-1", "egress-2", "egress-3", "egress-other", "unlabelled"])
        one = self.ok("GET", path, [("maxResults", "1"), ("filter", 'labels.egret-pool="lab"')])
        self.assertEqual(self.names(one), ["egress-1"])
        rest = self.ok("GET", path, [("maxResults", "1"), ("filter", 'labels.egret-pool="lab"'), ("pageToken", one["nextPageToken"])])
        self.assertEqual(self.names(rest), ["egress-2"])
        newest = self.ok("GET", P + f"zones/{ZONE_A}/instances", [("orderBy", "creationTimestamp desc")])
        self.assertEqual(len(newest["items"]), 2)
        self.assert_error(*self.api("GET", path, [("maxResults", "501")]), 400, "invalid", "INVALID_ARGUMENT")
        self.assert_error(*self.api("GET", path, [("pageToken", "bogus")]), 400, "invalid", "INVALID_ARGUMENT")
        self.assert_error(*self.api("GET", path, [("orderBy", "address")]), 400, "invalid", "INVALID_ARGUMENT")
        agg, token, seen = P + "aggregated/addresses", None, []
        while True:
            out = self.ok("GET", agg, [("pageToken", token)] if token else [])
            seen += [a["name"] for scope in out["items"].values() for a in scope.get("addresses", [])]
            self.assertIn("warning", out["items"]["regions/europe-west1"])
            token = out.get("nextPageToken")
            if not token:
                break
        self.assertEqual(seen, ["egress-1", "egress-2", "egress-3", "egress-other", "unlabelled"])

    # ---- errors and authentication --------------------------------------------

    def test_error_shapes(self):
        self.assert_error(*self.api("GET", P + f"regions/{REGION}/addresses/nope"), 404, "notFound", "NOT_FOUND")
        status, out = self.api("GET", "/compute/v1/projects/someone-else/regions/us-central1/addresses")
        self.assertEqual(self.assert_error(status, out, 404, "notFound", "NOT_FOUND")["message"], "The resource 'projects/someone-else' was not found")
        status, out = self.api("GET", P + "zones/us-central1/instances/gw-a")
        self.assertEqual(self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"], "Invalid value for field 'zone': 'us-central1'. Unknown zone.")
        status, out = self.api("GET", P + "global/networks/lab")
        self.assert_error(status, out, 501, "notImplemented", "UNIMPLEMENTED")
        status, out = self.api("GET", P + f"regions/{REGION}/addresses", [("fields", "items/name")])
        self.assertIn('Unknown name "fields"', self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"])
        req = urllib.request.Request(self.base + P + f"zones/{ZONE_A}/targetInstances?%24alt=json", data=b"{not json", method="POST",
                                     headers={"Authorization": "Bearer t", "Content-Type": "application/json"})
        with self.assertRaises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req)
        self.assert_error(caught.exception.code, json.load(caught.exception), 400, "parseError", "INVALID_ARGUMENT")
        # An endpoint given with a trailing "/" makes the client send "//compute/v1/...".
        self.assertEqual(self.api("GET", "/" + P + f"regions/{REGION}/addresses/egress-1")[0], 200)

    def test_authentication(self):
        path = P + f"regions/{REGION}/addresses/egress-1"
        status, out = self.api("GET", path, headers={"Authorization": None})
        self.assert_error(status, out, 401, "required", "UNAUTHENTICATED")
        self.assertTrue(self.last_headers["WWW-Authenticate"].startswith("Bearer"))
        self.assert_error(*self.api("GET", path, headers={"Authorization": "Basic dXNlcjpwYXNz"}), 401, "authError", "UNAUTHENTICATED")
        self.assert_error(*self.api("GET", path, headers={"Authorization": "Bearer "}), 401, "authError", "UNAUTHENTICATED")
        self.assert_error(*self.api("GET", path, headers={"Authorization": None, "x-goog-api-key": "k"}), 401, "required", "UNAUTHENTICATED")
        self.ctl("POST", "config", {"allowAnonymous": True})
        self.assertEqual(self.api("GET", path, headers={"Authorization": None})[0], 200)
        self.assertEqual(self.api("GET", path, headers={"Authorization": "Bearer anything-at-all"})[0], 200)

    def metadata(self, path, flavor="Google"):
        req = urllib.request.Request(self.base + path, headers={"Metadata-Flavor": flavor} if flavor else {})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def test_metadata_server_issues_the_tokens_compute_accepts(self):
        token_path = "/computeMetadata/v1/instance/service-accounts/default/token"
        self.assertEqual(self.metadata(token_path, flavor=None)[0], 403)
        self.assertEqual(self.metadata("/computeMetadata/v1/instance/hostname")[0], 404)
        self.assertEqual(self.metadata("/computeMetadata/v1/universe/universe-domain"), (200, "googleapis.com"))
        status, text = self.metadata(token_path + "?scopes=https://www.googleapis.com/auth/cloud-platform")
        self.assertEqual(status, 200, text)
        answer = json.loads(text)
        self.assertEqual((answer["token_type"], answer["expires_in"]), ("Bearer", 3599))
        logged = [e for e in self.ctl("GET", "requests") if e["api"] == "metadata.token"]
        self.assertEqual(logged[-1]["scopes"], "https://www.googleapis.com/auth/cloud-platform")
        path = P + f"regions/{REGION}/addresses/egress-1"
        self.ctl("POST", "config", {"requireIssuedTokens": True, "tokens": ["lab-admin"]})
        self.assert_error(*self.api("GET", path), 401, "authError", "UNAUTHENTICATED")
        self.assertEqual(self.api("GET", path, headers={"Authorization": "Bearer " + answer["access_token"]})[0], 200)
        self.assertEqual(self.api("GET", path, headers={"Authorization": "Bearer lab-admin"})[0], 200)

    def test_labels_control_call_relabels_an_address(self):
        out = self.ctl("POST", "labels", {"region": REGION, "name": "egress-1", "labels": {"egret-pool": "retired"}})
        self.assertEqual(out["labels"], {"egret-pool": "retired"})
        listed = self.ok("GET", P + f"regions/{REGION}/addresses", [("filter", 'labels.egret-pool="lab"')])
        self.assertEqual(self.names(listed), ["egress-2", "egress-3"])

    # ---- throttling, staleness, faults -----------------------------------------

    def test_throttling_per_group_and_window(self):
        window = 0.5
        self.ctl("POST", "config", {"quota": {"read": 3, "mutation": 1, "window": window}})
        time.sleep(window - time.time() % window + 0.02)  # start just after a window opens
        path = P + f"regions/{REGION}/addresses/egress-1"
        self.assertEqual([self.api("GET", path)[0] for _ in range(3)], [200, 200, 200])
        status, out = self.api("GET", path)
        err = self.assert_error(status, out, 403, "rateLimitExceeded", "PERMISSION_DENIED")
        self.assertEqual(err["errors"][0]["domain"], "usageLimits")
        # Mutations have their own quota.
        self.assertEqual(self.api("POST", P + f"zones/{ZONE_A}/targetInstances", body={"name": "ti-a", "instance": "gw-a"})[0], 200)
        self.assert_error(*self.api("POST", P + f"zones/{ZONE_B}/targetInstances", body={"name": "ti-b", "instance": "gw-b"}), 403, "rateLimitExceeded", "PERMISSION_DENIED")
        time.sleep(window - time.time() % window + 0.02)
        self.assertEqual(self.api("GET", path)[0], 200)

    def test_staleness_serves_the_previous_version(self):
        self.insert_target("ti-a", ZONE_A, "gw-a")
        self.ctl("POST", "config", {"staleness": 0.4})
        self.insert_rule("r1", "egress-1", self.ti_link(ZONE_A, "ti-a"))
        # DONE, and the network delivers already; reads still show the old state.
        self.assertEqual(self.route_of("egress-1"), "gw-a")
        self.assert_error(*self.api("GET", P + f"regions/{REGION}/forwardingRules/r1"), 404, "notFound", "NOT_FOUND")
        self.assertNotIn("items", self.ok("GET", P + f"regions/{REGION}/forwardingRules"))
        addr = self.ok("GET", P + f"regions/{REGION}/addresses/egress-1")
        self.assertEqual(addr["status"], "RESERVED")
        self.assertNotIn("users", addr)
        time.sleep(0.45)
        self.assertEqual(self.ok("GET", P + f"regions/{REGION}/forwardingRules/r1")["name"], "r1")
        listed = self.ok("GET", P + f"regions/{REGION}/addresses", [("filter", "status=IN_USE")])
        self.assertEqual(self.names(listed), ["egress-1"])

    def test_faults(self):
        path = P + f"regions/{REGION}/addresses"
        armed = self.ctl("POST", "faults", {"api": "addresses.list", "status": 503, "times": 2})
        self.assertEqual((armed["reason"], armed["times"]), ("backendError", 2))
        for _ in range(2):
            self.assert_error(*self.api("GET", path), 503, "backendError", "UNAVAILABLE")
        self.assertEqual(self.api("GET", path)[0], 200)
        self.assertEqual(self.ctl("GET", "faults"), [])
        self.ctl("POST", "faults", {"method": "GET", "path": r"/addresses/egress-2$", "stall": 0.3})
        start = time.time()
        self.assertEqual(self.api("GET", path + "/egress-2")[0], 200)
        self.assertGreaterEqual(time.time() - start, 0.3)
        opfail = {"code": "QUOTA_EXCEEDED", "message": "Quota 'TARGET_INSTANCES' exceeded.", "httpStatus": 403}
        self.assertEqual(self.ctl("POST", "faults", {"api": "targetInstances.insert", "operationError": opfail})["operationError"], opfail)
        op = self.ok("POST", P + f"zones/{ZONE_A}/targetInstances", body={"name": "ti-a", "instance": "gw-a"})
        done = self.ok("POST", self.op_path(op) + "/wait")
        self.assertEqual(done["error"], {"errors": [{"code": "QUOTA_EXCEEDED", "message": "Quota 'TARGET_INSTANCES' exceeded."}]})
        self.assertEqual((done["httpErrorStatusCode"], done["httpErrorMessage"]), (403, "FORBIDDEN"))
        self.assert_error(*self.api("GET", P + f"zones/{ZONE_A}/targetInstances/ti-a"), 404, "notFound", "NOT_FOUND")
        self.ctl("POST", "faults", {"status": 429, "times": None})
        self.assert_error(*self.api("GET", path), 429, "rateLimitExceeded", "RESOURCE_EXHAUSTED")
        self.assert_error(*self.api("GET", path), 429, "rateLimitExceeded", "RESOURCE_EXHAUSTED")
        self.assertEqual(self.ctl("DELETE", "faults"), [])
        self.assertEqual(self.api("GET", path)[0], 200)

    # ---- instances: alias ranges, access configs -------------------------------

    def nic0(self, name, zone=ZONE_A):
        return self.ok("GET", P + f"zones/{zone}/instances/{name}")["networkInterfaces"][0]

    def update_nic(self, name, body, zone=ZONE_A):
        return self.api("PATCH", P + f"zones/{zone}/instances/{name}/updateNetworkInterface", [("networkInterface", "nic0")], body)

    def test_update_network_interface_checks_the_fingerprint(self):
        nic = self.nic0("gw-a")
        self.assertRegex(nic["fingerprint"], r"^[A-Za-z0-9_-]{11}=$")
        status, op = self.update_nic("gw-a", {"fingerprint": nic["fingerprint"], "aliasIpRanges": [{"ipCidrRange": "198.18.1.32"}]})
        self.assertEqual((status, op["operationType"]), (200, "updateNetworkInterface"))
        self.wait(op)
        after = self.nic0("gw-a")
        self.assertEqual(after["aliasIpRanges"], [{"ipCidrRange": "198.18.1.32/32"}])
        self.assertNotEqual(after["fingerprint"], nic["fingerprint"])
        status, out = self.update_nic("gw-a", {"fingerprint": nic["fingerprint"], "aliasIpRanges": []})
        self.assert_error(status, out, 412, "conditionNotMet", "FAILED_PRECONDITION")
        status, out = self.update_nic("gw-a", {"fingerprint": after["fingerprint"], "aliasIpRanges": [{"ipCidrRange": "198.18.9.1/32"}]})
        self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")
        # The client omits an empty aliasIpRanges: PATCH keeps the ranges.
        self.wait(self.update_nic("gw-a", {"fingerprint": after["fingerprint"]})[1])
        kept = self.nic0("gw-a")
        self.assertEqual(kept["aliasIpRanges"], [{"ipCidrRange": "198.18.1.32/32"}])
        # Sending back the interface as read (network, subnetwork, ...) is fine;
        # a secondary range is named by subnetworkRangeName.
        body = dict(kept, aliasIpRanges=[{"subnetworkRangeName": "pods", "ipCidrRange": "198.18.64.0/24"}])
        self.wait(self.update_nic("gw-a", body)[1])
        self.assertEqual(self.nic0("gw-a")["aliasIpRanges"], [{"ipCidrRange": "198.18.64.0/24", "subnetworkRangeName": "pods"}])
        aliases = self.ctl("GET", "routing")["aliasIpRanges"]
        self.assertEqual([(a["ipCidrRange"], a["instance"]["name"]) for a in aliases], [("198.18.64.0/24", "gw-a")])
        # Two updates sent with the same fingerprint: the later one loses at commit.
        fp = self.nic0("gw-b", ZONE_B)["fingerprint"]
        first = self.update_nic("gw-b", {"fingerprint": fp, "aliasIpRanges": [{"ipCidrRange": "198.18.1.40/32"}]}, ZONE_B)[1]
        second = self.update_nic("gw-b", {"fingerprint": fp, "aliasIpRanges": [{"ipCidrRange": "198.18.1.41/32"}]}, ZONE_B)[1]
        self.wait(first)
        lost = self.ok("POST", self.op_path(second) + "/wait")
        self.assertEqual((lost["error"]["errors"][0]["code"], lost["httpErrorStatusCode"]), ("CONDITION_NOT_MET", 412))
        self.assertEqual(self.nic0("gw-b", ZONE_B)["aliasIpRanges"], [{"ipCidrRange": "198.18.1.40/32"}])
        # A range another instance holds fails in the operation.
        fp = self.nic0("gw-c")["fingerprint"]
        taken = self.ok("POST", self.op_path(self.update_nic("gw-c", {"fingerprint": fp, "aliasIpRanges": [{"ipCidrRange": "198.18.1.40/32"}]})[1]) + "/wait")
        self.assertEqual(taken["error"]["errors"][0]["code"], "IP_IN_USE_BY_ANOTHER_RESOURCE")

    def test_access_configs(self):
        add = P + f"zones/{ZONE_A}/instances/gw-a/addAccessConfig"
        ac = {"type": "ONE_TO_ONE_NAT", "name": "External NAT", "natIP": "203.0.113.30"}
        op = self.ok("POST", add, [("networkInterface", "nic0")], ac)
        self.assertEqual(op["operationType"], "addAccessConfig")
        self.wait(op)
        self.assertEqual(self.nic0("gw-a")["accessConfigs"][0]["natIP"], "203.0.113.30")
        routing = next(a for a in self.ctl("GET", "routing")["addresses"] if a["name"] == "unlabelled")
        self.assertEqual((routing["routes"][0]["via"], routing["instance"]["name"]), ("accessConfig", "gw-a"))
        addr = self.ok("GET", P + f"regions/{REGION}/addresses/unlabelled")
        self.assertEqual((addr["status"], addr["users"][0].rsplit("/", 1)[1]), ("IN_USE", "gw-a"))
        status, out = self.api("POST", add, [("networkInterface", "nic0")], dict(ac, natIP="203.0.113.11"))
        self.assertEqual(self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"], "At most one access config currently supported.")
        status, out = self.api("POST", P + f"zones/{ZONE_B}/instances/gw-b/addAccessConfig", [("networkInterface", "nic0")], dict(ac, natIP="192.0.2.7"))
        self.assertIn("was not found in region", self.assert_error(status, out, 400, "invalid", "INVALID_ARGUMENT")["message"])
        self.assert_error(*self.api("POST", P + f"zones/{ZONE_B}/instances/gw-b/addAccessConfig", body=ac), 400, "required", "INVALID_ARGUMENT")
        clash = self.ok("POST", P + f"zones/{ZONE_B}/instances/gw-b/addAccessConfig", [("networkInterface", "nic0")], ac)
        clash = self.ok("POST", self.op_path(clash) + "/wait")
        self.assertEqual(clash["error"]["errors"][0]["code"], "IP_IN_USE_BY_ANOTHER_RESOURCE")
        delete = P + f"zones/{ZONE_A}/instances/gw-a/deleteAccessConfig"
        self.assert_error(*self.api("POST", delete, [("accessConfig", "Other"), ("networkInterface", "nic0")]), 400, "invalid", "INVALID_ARGUMENT")
        self.wait(self.ok("POST", delete, [("accessConfig", "External NAT"), ("networkInterface", "nic0")]))
        self.assertNotIn("accessConfigs", self.nic0("gw-a"))
        self.assertIsNone(self.route_of("unlabelled"))

    def test_instances_and_subnetworks(self):
        inst = self.ok("GET", P + f"zones/{ZONE_A}/instances/gw-a")
        self.assertEqual((inst["kind"], inst["status"], inst["canIpForward"]), ("compute#instance", "RUNNING", True))
        self.assertTrue(inst["id"].isdigit())
        nic = inst["networkInterfaces"][0]
        self.assertEqual((nic["name"], nic["networkIP"]), ("nic0", "198.18.1.10"))
        self.assertTrue(nic["subnetwork"].endswith(f"/regions/{REGION}/subnetworks/gateways"))
        listed = self.ok("GET", P + f"zones/{ZONE_A}/instances", [("filter", 'name = "gw-c"')])
        self.assertEqual(self.names(listed), ["gw-c"])
        subnet = self.ok("GET", P + f"regions/{REGION}/subnetworks/gateways", [("views", "DEFAULT")])
        self.assertEqual((subnet["ipCidrRange"], subnet["gatewayAddress"]), ("198.18.1.0/24", "198.18.1.1"))
        self.assertEqual(subnet["secondaryIpRanges"], [{"rangeName": "pods", "ipCidrRange": "198.18.64.0/18"}])
        self.assert_error(*self.api("GET", P + f"regions/{REGION}/subnetworks/none"), 404, "notFound", "NOT_FOUND")

    # ---- the request log --------------------------------------------------------

    def test_request_log_records_what_the_client_sent(self):
        self.ctl("DELETE", "requests")
        self.ok("GET", P + f"regions/{REGION}/addresses", [("filter", 'labels.egret-pool="lab"'), ("maxResults", "10")])
        body = {"name": "ti-a", "instance": f"zones/{ZONE_A}/instances/gw-a", "natPolicy": "NO_NAT"}
        op = self.ok("POST", P + f"zones/{ZONE_A}/targetInstances", body=body)
        self.api("GET", self.op_path(op), system=False)
        self.api("GET", P + "global/networks/lab")
        log = self.ctl("GET", "requests")
        self.assertEqual([e["api"] for e in log], ["addresses.list", "targetInstances.insert", "zoneOperations.get", None])
        self.assertEqual(log[0]["query"], {"filter": 'labels.egret-pool="lab"', "maxResults": "10", "$alt": "json", "$apiVersion": API_VERSION})
        self.assertEqual((log[0]["method"], log[0]["path"], log[0]["authorization"], log[0]["status"]),
                         ("GET", P + f"regions/{REGION}/addresses", "bearer", 200))
        self.assertEqual((log[1]["method"], log[1]["body"]), ("POST", body))
        self.assertEqual(log[2]["query"], {"$alt": "json"})
        self.assertEqual(log[3]["status"], 501)
        later = self.ctl("GET", f"requests?since={log[2]['seq']}")
        self.assertEqual([e["seq"] for e in later], [log[2]["seq"], log[3]["seq"]])


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@unittest.skipUnless(shutil.which("openssl"), "openssl is needed to make a test certificate")
class TlsTest(unittest.TestCase):
    def test_serves_https_with_the_given_chain(self):
        with tempfile.TemporaryDirectory() as d:
            ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
            openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test CA",
                    "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=d)
            openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=emulator", cwd=d)
            with open(os.path.join(d, "server.ext"), "w") as f:
                f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
            openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                    "-days", "1", "-out", "server.pem", "-extfile", "server.ext", cwd=d)
            server = gcp_emulator.Server(gcp_emulator.Emulator(), tls_dir=d, quiet=True)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            try:
                ctx = ssl.create_default_context(cafile=os.path.join(d, "ca.pem"))
                req = urllib.request.Request(f"https://127.0.0.1:{server.port}{P}regions/{REGION}/addresses/egress-1?%24alt=json",
                                             headers={"Authorization": "Bearer t"})
                with urllib.request.urlopen(req, context=ctx) as r:
                    self.assertEqual(json.load(r)["address"], "203.0.113.10")
                with self.assertRaises(urllib.error.URLError):
                    urllib.request.urlopen(req, context=ssl.create_default_context())
            finally:
                server.shutdown()
                server.server_close()


@unittest.skipUnless(shutil.which("curl") and shutil.which("flock") and shutil.which("setsid"), "the script needs curl, flock and setsid")
class ScriptTest(unittest.TestCase):
    def test_start_status_env_stop(self):
        script = os.path.join(HERE, "gcp-emulator.sh")
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, EGRET_GCP_EMULATOR_STATE=os.path.join(d, "state"), EGRET_GCP_EMULATOR_OWNER_PID=str(os.getpid()),
                       EGRET_GCP_EMULATOR_ARGS="--allow-anonymous --operation-delay 0")

            def run(cmd):
                return subprocess.run([script, cmd], env=env, capture_output=True, text=True, timeout=60)

            try:
                started = run("start")
                self.assertEqual(started.returncode, 0, started.stderr)
                endpoint = started.stdout.strip().splitlines()[-1]
                self.assertRegex(endpoint, r"^http://127\.0\.0\.1:\d+$")
                with urllib.request.urlopen(f"{endpoint}{P}regions/{REGION}/addresses/egress-2?%24alt=json") as r:
                    self.assertEqual(json.load(r)["address"], "203.0.113.11")  # anonymous, as configured
                self.assertEqual(run("status").returncode, 0)
                self.assertIn(f"EGRET_GCP_EMULATOR_ENDPOINT={endpoint}", run("env").stdout.splitlines())
            finally:
                stopped = run("stop")
            self.assertEqual(stopped.returncode, 0, stopped.stderr)
            self.assertEqual(run("status").returncode, 3)
            with self.assertRaises(urllib.error.URLError):
                urllib.request.urlopen(f"{endpoint}/_emulator/health", timeout=2)


if __name__ == "__main__":
    unittest.main()
