#!/usr/bin/env python3
"""The ARM emulator's self-test: each emulated call, and each behaviour the
Azure provider's tests will lean on, checked over HTTP against an emulator
started in this process on 127.0.0.1 (and once over HTTPS, and once through
azure-emulator.sh).

Run: python3 tests/emulators/azure/test_emulator.py  (standard library only;
the HTTPS tests also run openssl, listed in tests/tools.txt).
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree

import emulator  # noqa: E402

SUB = "00000000-0000-4000-8000-000000000001"
RG = f"/subscriptions/{SUB}/resourceGroups/egret"
NET = f"{RG}/providers/Microsoft.Network"
NETWORK_API = "api-version=2024-05-01"
VM_GW_A = f"{RG}/providers/Microsoft.Compute/virtualMachines/gw-a?api-version=2024-07-01"
TAG = "egret-pool"


def resources(filt: str | None = None, api: str = "2021-04-01", sub: str = SUB) -> str:
    """A Resources - List URL path with an optional $filter."""
    where = f"$filter={quote(filt)}&" if filt is not None else ""
    return f"/subscriptions/{sub}/resources?{where}api-version={api}"


def ipconfig(nic: str, name: str) -> str:
    return f"{NET}/networkInterfaces/{nic}/ipConfigurations/{name}"

SEED = {
    "subscriptionId": SUB,
    "resourceGroups": ["egret"],
    "virtualNetworks": [
        {
            "resourceGroup": "egret",
            "name": "vnet",
            "subnets": [
                {"name": "gateways", "addressPrefix": "198.18.1.0/24"},
                {"name": "other", "addressPrefix": "198.18.2.0/24"},
            ],
        }
    ],
    "publicIPAddresses": [
        {"resourceGroup": "egret", "name": "egress-1", "ipAddress": "203.0.113.10", "tags": {TAG: "a"}},
        {"resourceGroup": "egret", "name": "egress-2", "ipAddress": "203.0.113.11", "tags": {TAG: "a"}},
        {"resourceGroup": "egret", "name": "pool-b", "ipAddress": "203.0.113.20", "tags": {TAG: "b"}},
        {"resourceGroup": "egret", "name": "untagged", "ipAddress": "203.0.113.30"},
    ],
    "networkInterfaces": [
        {
            "resourceGroup": "egret",
            "name": "nic-a",
            "enableIPForwarding": True,
            "ipConfigurations": [
                {"name": "ipconfig1", "subnet": "vnet/gateways", "privateIPAddress": "198.18.1.4", "primary": True},
                {"name": "egress-1", "privateIPAddress": "198.18.1.20", "publicIPAddress": "egress-1"},
            ],
        },
        {
            "resourceGroup": "egret",
            "name": "nic-a2",
            "ipConfigurations": [{"name": "ipconfig1", "subnet": "vnet/other", "privateIPAddress": "198.18.2.4"}],
        },
        {
            "resourceGroup": "egret",
            "name": "nic-b",
            "enableIPForwarding": True,
            "ipConfigurations": [{"name": "ipconfig1", "subnet": "vnet/gateways", "privateIPAddress": "198.18.1.5"}],
        },
    ],
    "virtualMachines": [
        {"resourceGroup": "egret", "name": "gw-a", "networkInterfaces": ["nic-a", "nic-a2"]},
        {"resourceGroup": "egret", "name": "gw-b", "networkInterfaces": ["nic-b"]},
    ],
}


@dataclass
class Reply:
    status: int
    headers: Message
    body: object


def call(
    base: str,
    method: str,
    target: str,
    body: object = None,
    headers: dict[str, str] | None = None,
    token: str | None = "egret-test",
    context: ssl.SSLContext | None = None,
) -> Reply:
    """One HTTP call; `target` is a path on `base` or a whole URL (a nextLink)."""
    url = target if "://" in target else base + target
    sent = {"Content-Type": "application/json"} if body is not None else {}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    sent.update(headers or {})
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(req, context=context, timeout=10) as r:
            return Reply(r.status, r.headers, json.loads(r.read() or b"null"))
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.headers, json.loads(e.read() or b"null"))


class EmulatorTest(unittest.TestCase):
    """One emulator for the class, reset and seeded before each test."""

    server: emulator.Server

    @classmethod
    def setUpClass(cls) -> None:
        cls.server = emulator.Server(("127.0.0.1", 0))
        threading.Thread(target=cls.server.serve_forever, daemon=True).start()

    @classmethod
    def tearDownClass(cls) -> None:
        cls.server.shutdown()
        cls.server.server_close()

    def setUp(self) -> None:
        self.control("POST", "reset")
        self.control("PUT", "config", {"asyncDelay": 0.1})
        self.ids = self.control("POST", "seed", SEED)

    def arm(self, method: str, target: str, body: object = None, **kw) -> Reply:
        return call(self.server.url, method, target, body, **kw)

    def control(self, method: str, what: str, body: object = None) -> object:
        reply = call(self.server.url, method, f"/_emulator/{what}", body, token=None)
        self.assertEqual(reply.status, 200, reply.body)
        return reply.body

    def assertError(self, reply: Reply, status: int, code: str) -> None:
        self.assertEqual((reply.status, reply.body["error"]["code"]), (status, code), reply.body)

    def nic(self, name: str) -> dict:
        reply = self.arm("GET", f"{NET}/networkInterfaces/{name}?{NETWORK_API}")
        self.assertEqual(reply.status, 200, reply.body)
        return reply.body

    def put_nic(self, nic: dict, **kw) -> Reply:
        return self.arm("PUT", f"{NET}/networkInterfaces/{nic['name']}?{NETWORK_API}", nic, **kw)

    def wait(self, accepted: Reply) -> dict:
        """Polls an accepted PUT's Azure-AsyncOperation URL until it ends."""
        self.assertIn(accepted.status, (200, 201), accepted.body)
        url = accepted.headers["Azure-AsyncOperation"]
        deadline = time.monotonic() + 5
        while True:
            status = self.arm("GET", url)
            self.assertEqual(status.status, 200, status.body)
            if status.body["status"] != "InProgress":
                return status.body
            self.assertLess(time.monotonic(), deadline, "the operation never ended")
            time.sleep(0.02)

    def routing(self) -> dict:
        return self.control("GET", "routing")

    @staticmethod
    def secondary(name: str, address: str, pip: str | None) -> dict:
        props: dict = {
            "privateIPAddress": address,
            "privateIPAllocationMethod": "Static",
            "subnet": {"id": f"{NET}/virtualNetworks/vnet/subnets/gateways"},
        }
        if pip:
            props["publicIPAddress"] = {"id": f"{NET}/publicIPAddresses/{pip}"}
        return {"name": name, "properties": props}

    def without(self, nic: dict, name: str) -> dict:
        nic["properties"]["ipConfigurations"] = [c for c in nic["properties"]["ipConfigurations"] if c["name"] != name]
        return nic

    # ---------------------------------------------------------- discovery ---

    def test_tag_discovery_returns_the_tagged_addresses_without_their_tags(self):
        reply = self.arm("GET", resources(f"tagName eq '{TAG}' and tagValue eq 'a'"))
        self.assertEqual(reply.status, 200, reply.body)
        rows = reply.body["value"]
        self.assertEqual(sorted(r["name"] for r in rows), ["egress-1", "egress-2"])
        self.assertTrue(all(r["type"] == "Microsoft.Network/publicIPAddresses" for r in rows))
        self.assertTrue(all("tags" not in r for r in rows), "a tag filter leaves the tags out")
        self.assertNotIn("nextLink", reply.body)

        by_name = self.arm("GET", resources(f"tagName eq '{TAG}'"))
        self.assertEqual(sorted(r["name"] for r in by_name.body["value"]), ["egress-1", "egress-2", "pool-b"])

        typed = self.arm("GET", resources("resourceType eq 'Microsoft.Network/publicIPAddresses'"))
        self.assertEqual(len(typed.body["value"]), 4)
        self.assertEqual({r["name"]: r.get("tags") for r in typed.body["value"]}["pool-b"], {TAG: "b"})

        bad = self.arm("GET", resources("name eq 1"))
        self.assertError(bad, 400, "InvalidFilterInQueryString")

    def test_public_ip_lists_and_get_carry_tags_address_and_association(self):
        for path in (f"{NET}/publicIPAddresses", f"/subscriptions/{SUB}/providers/Microsoft.Network/publicIPAddresses"):
            reply = self.arm("GET", f"{path}?{NETWORK_API}")
            self.assertEqual(reply.status, 200, reply.body)
            pips = {p["name"]: p for p in reply.body["value"]}
            self.assertEqual(set(pips), {"egress-1", "egress-2", "pool-b", "untagged"})
            self.assertEqual(pips["egress-2"]["tags"], {TAG: "a"})
        one = self.arm("GET", f"{NET}/publicIPAddresses/egress-1?{NETWORK_API}").body
        self.assertEqual(one["properties"]["ipAddress"], "203.0.113.10")
        self.assertEqual(one["properties"]["publicIPAllocationMethod"], "Static")
        self.assertEqual(one["sku"]["name"], "Standard")
        self.assertEqual(one["properties"]["provisioningState"], "Succeeded")
        self.assertEqual(one["properties"]["ipConfiguration"]["id"], ipconfig("nic-a", "egress-1"))
        self.assertTrue(one["etag"].startswith('W/"'))
        free = self.arm("GET", f"{NET}/publicIPAddresses/egress-2?{NETWORK_API}").body
        self.assertNotIn("ipConfiguration", free["properties"])
        missing = self.arm("GET", f"{NET}/publicIPAddresses/nope?{NETWORK_API}")
        self.assertError(missing, 404, "ResourceNotFound")
        no_group = f"/subscriptions/{SUB}/resourceGroups/nope/providers/Microsoft.Network/publicIPAddresses"
        self.assertError(self.arm("GET", f"{no_group}?{NETWORK_API}"), 404, "ResourceGroupNotFound")

    def test_lists_page_with_next_links_that_keep_the_query(self):
        self.control("PUT", "config", {"pageSize": 3})
        pages, names = 0, []
        url = f"{NET}/publicIPAddresses?{NETWORK_API}"
        while url:
            reply = self.arm("GET", url)
            self.assertEqual(reply.status, 200, reply.body)
            pages += 1
            names += [p["name"] for p in reply.body["value"]]
            url = reply.body.get("nextLink")
            if url:
                self.assertTrue(url.startswith(self.server.url) and "api-version=2024-05-01" in url, url)
        self.assertEqual((pages, sorted(names)), (2, ["egress-1", "egress-2", "pool-b", "untagged"]))

        self.control("PUT", "config", {"pageSize": 1})
        url, names = resources(f"tagName eq '{TAG}'"), []
        while url:
            reply = self.arm("GET", url)
            self.assertEqual(reply.status, 200, reply.body)
            self.assertLessEqual(len(reply.body["value"]), 1)
            names += [r["name"] for r in reply.body["value"]]
            url = reply.body.get("nextLink")
        self.assertEqual(sorted(names), ["egress-1", "egress-2", "pool-b"], "the filter survives the nextLink")

    def test_vm_names_its_nics_and_the_subnet_its_ip_configurations(self):
        vm = self.arm("GET", VM_GW_A)
        self.assertEqual(vm.status, 200, vm.body)
        self.assertEqual(
            vm.body["properties"]["networkProfile"]["networkInterfaces"],
            [
                {"id": f"{NET}/networkInterfaces/nic-a", "properties": {"primary": True}},
                {"id": f"{NET}/networkInterfaces/nic-a2", "properties": {"primary": False}},
            ],
        )
        self.assertTrue(vm.body["properties"]["vmId"])
        self.assertEqual(vm.body["id"], self.ids["virtualMachines"]["gw-a"])
        nic = self.nic("nic-a")
        self.assertTrue(nic["properties"]["enableIPForwarding"])
        self.assertEqual(nic["properties"]["virtualMachine"]["id"], vm.body["id"])
        configs = {c["name"]: c["properties"] for c in nic["properties"]["ipConfigurations"]}
        self.assertEqual(configs["ipconfig1"]["privateIPAddress"], "198.18.1.4")
        self.assertTrue(configs["ipconfig1"]["primary"])
        self.assertEqual(configs["egress-1"]["subnet"], configs["ipconfig1"]["subnet"], "the primary's subnet")
        subnet = self.arm("GET", f"{NET}/virtualNetworks/vnet/subnets/gateways?{NETWORK_API}")
        self.assertEqual(subnet.body["properties"]["addressPrefix"], "198.18.1.0/24")
        self.assertEqual(
            sorted(i["id"].rsplit("/networkInterfaces/", 1)[1] for i in subnet.body["properties"]["ipConfigurations"]),
            ["nic-a/ipConfigurations/egress-1", "nic-a/ipConfigurations/ipconfig1", "nic-b/ipConfigurations/ipconfig1"],
        )

    def test_nic_list_of_a_resource_group_pages_whole_nics(self):
        self.control("PUT", "config", {"pageSize": 1})
        url, nics = f"{NET}/networkInterfaces?{NETWORK_API}", {}
        while url:
            reply = self.arm("GET", url)
            self.assertEqual(reply.status, 200, reply.body)
            self.assertLessEqual(len(reply.body["value"]), 1)
            nics.update({n["name"]: n for n in reply.body["value"]})
            url = reply.body.get("nextLink")
        self.assertEqual(set(nics), {"nic-a", "nic-a2", "nic-b"})
        self.assertEqual(nics["nic-a"], self.nic("nic-a"), "as Get shows it")
        no_group = f"/subscriptions/{SUB}/resourceGroups/nope/providers/Microsoft.Network/networkInterfaces"
        self.assertError(self.arm("GET", f"{no_group}?{NETWORK_API}"), 404, "ResourceGroupNotFound")

    # -------------------------------------------------------------- moves ---

    def test_a_move_is_two_nic_puts_and_one_put_is_refused(self):
        nic_b = self.nic("nic-b")
        nic_b["properties"]["ipConfigurations"].append(self.secondary("egress-1", "198.18.1.21", "egress-1"))
        refused = self.put_nic(nic_b)
        self.assertError(refused, 400, "PublicIPAddressInUse")
        self.assertIn(f"{NET}/networkInterfaces/nic-a/ipConfigurations/egress-1", refused.body["error"]["message"])
        same_private = self.nic("nic-b")
        same_private["properties"]["ipConfigurations"].append(self.secondary("egress-1", "198.18.1.20", None))
        self.assertError(self.put_nic(same_private), 400, "PrivateIPAddressIsAllocated")

        cleared = self.put_nic(self.without(self.nic("nic-a"), "egress-1"))
        self.assertEqual(cleared.status, 200, cleared.body)
        # Until the clearing commits, the public IP is still nic-a's.
        self.assertError(self.put_nic(nic_b), 400, "PublicIPAddressInUse")
        self.assertEqual(self.wait(cleared)["status"], "Succeeded")
        self.assertIsNone(self.routing()["publicIPAddresses"]["203.0.113.10"]["networkInterface"])
        self.assertEqual(self.wait(self.put_nic(nic_b))["status"], "Succeeded")

        where = self.routing()["publicIPAddresses"]["203.0.113.10"]
        self.assertEqual(where["networkInterface"], self.ids["networkInterfaces"]["nic-b"])
        self.assertEqual(where["virtualMachine"], self.ids["virtualMachines"]["gw-b"])
        self.assertEqual(where["privateIPAddress"], "198.18.1.21")
        self.assertEqual(self.routing()["privateIPAddresses"]["198.18.1.21"]["publicIPAddress"], "203.0.113.10")
        self.assertNotIn("198.18.1.20", self.routing()["privateIPAddresses"])
        pip = self.arm("GET", f"{NET}/publicIPAddresses/egress-1?{NETWORK_API}").body
        self.assertEqual(pip["properties"]["ipConfiguration"]["id"], ipconfig("nic-b", "egress-1"))

    # ---------------------------------------------------- async operations ---

    def test_a_nic_put_commits_when_its_operation_completes(self):
        self.control("PUT", "config", {"asyncDelay": 0.3})
        before = self.nic("nic-b")
        nic = json.loads(json.dumps(before))
        nic["properties"]["ipConfigurations"].append(self.secondary("egress-2", "198.18.1.22", "egress-2"))
        accepted = self.put_nic(nic)
        self.assertEqual(accepted.status, 200, accepted.body)
        self.assertEqual(accepted.body["properties"]["provisioningState"], "Updating")
        self.assertEqual(accepted.headers["Retry-After"], "1")
        operation = accepted.headers["Azure-AsyncOperation"]
        self.assertIn("/providers/Microsoft.Network/locations/westeurope/operations/", operation)
        self.assertIn("/operationResults/", accepted.headers["Location"])

        running = self.nic("nic-b")
        self.assertEqual(running["properties"]["provisioningState"], "Updating")
        self.assertEqual(len(running["properties"]["ipConfigurations"]), 1, "not visible before the commit")
        self.assertEqual(running["etag"], before["etag"])
        pip = self.arm("GET", f"{NET}/publicIPAddresses/egress-2?{NETWORK_API}").body
        self.assertNotIn("ipConfiguration", pip["properties"])
        status = self.arm("GET", operation)
        self.assertEqual((status.body["status"], status.headers["Retry-After"]), ("InProgress", "1"))
        self.assertEqual(self.arm("GET", accepted.headers["Location"]).status, 202)
        self.assertError(self.put_nic(nic), 429, "RetryableErrorDueToAnotherOperation")

        operation_id = operation.rsplit("/", 1)[1].split("?")[0]
        self.assertEqual(self.wait(accepted), {"name": operation_id, "status": "Succeeded"})
        after = self.nic("nic-b")
        self.assertEqual(after["properties"]["provisioningState"], "Succeeded")
        self.assertEqual(after["etag"], accepted.body["etag"])
        self.assertNotEqual(after["etag"], before["etag"])
        self.assertEqual(len(after["properties"]["ipConfigurations"]), 2)
        result = self.arm("GET", accepted.headers["Location"])
        self.assertEqual((result.status, result.body["etag"]), (200, after["etag"]))
        pip = self.arm("GET", f"{NET}/publicIPAddresses/egress-2?{NETWORK_API}").body
        self.assertEqual(pip["properties"]["ipConfiguration"]["id"], ipconfig("nic-b", "egress-2"))

    def test_an_operation_armed_to_fail_leaves_the_nic_unchanged_and_failed(self):
        error = {"code": "InternalServerError", "message": "boom"}
        self.control("POST", "faults", {"method": "PUT", "path": "*/networkInterfaces/nic-b", "asyncError": error})
        nic = self.nic("nic-b")
        nic["properties"]["ipConfigurations"].append(self.secondary("egress-2", "198.18.1.22", "egress-2"))
        accepted = self.put_nic(nic)
        status = self.wait(accepted)
        self.assertEqual((status["status"], status["error"]["code"]), ("Failed", "InternalServerError"))
        self.assertError(self.arm("GET", accepted.headers["Location"]), 500, "InternalServerError")
        now = self.nic("nic-b")
        self.assertEqual(now["properties"]["provisioningState"], "Failed")
        self.assertEqual(len(now["properties"]["ipConfigurations"]), 1)
        self.assertIsNone(self.routing()["publicIPAddresses"]["203.0.113.11"]["networkInterface"])
        self.assertEqual(self.wait(self.put_nic(nic))["status"], "Succeeded", "the fault was armed once")

    def test_if_match_with_a_stale_etag_is_412(self):
        nic = self.nic("nic-b")
        stale = nic["etag"]
        nic["properties"]["enableIPForwarding"] = False
        self.wait(self.put_nic(nic, headers={"If-Match": stale}))
        refused = self.put_nic(nic, headers={"If-Match": stale})
        self.assertError(refused, 412, "PreconditionFailed")
        current = self.nic("nic-b")
        self.assertFalse(current["properties"]["enableIPForwarding"])
        self.assertEqual(self.put_nic(current, headers={"If-Match": current["etag"]}).status, 200)
        self.assertError(
            self.arm("PUT", f"{NET}/networkInterfaces/new-nic?{NETWORK_API}", current, headers={"If-Match": "*"}),
            412,
            "PreconditionFailed",
        )

    # -------------------------------------------------------- NIC checks ---

    def test_nic_puts_are_checked_as_arm_does(self):
        def with_secondary(address: str, pip: str | None = None) -> dict:
            nic = self.nic("nic-b")
            nic["properties"]["ipConfigurations"].append(self.secondary("extra", address, pip))
            return nic

        for reserved in ("198.18.1.0", "198.18.1.1", "198.18.1.2", "198.18.1.3", "198.18.1.255"):
            self.assertError(self.put_nic(with_secondary(reserved)), 400, "PrivateIPAddressInReservedRange")
        self.assertError(self.put_nic(with_secondary("198.18.2.10")), 400, "PrivateIPAddressNotInSubnet")
        self.assertError(self.put_nic(with_secondary("198.18.1.4")), 400, "PrivateIPAddressIsAllocated")
        self.assertError(self.put_nic(with_secondary("198.18.1.30", "nope")), 400, "InvalidResourceReference")

        two = with_secondary("198.18.1.30")
        for c in two["properties"]["ipConfigurations"]:
            c["properties"]["primary"] = True
        self.assertError(self.put_nic(two), 400, "NetworkInterfaceMustHaveOneOneIPConfigAsPrimary")
        for c in two["properties"]["ipConfigurations"]:
            c["properties"]["primary"] = False
        self.assertError(self.put_nic(two), 400, "NetworkInterfaceMustHaveOneOneIPConfigAsPrimary")

        renamed = self.nic("nic-b")
        renamed["properties"]["ipConfigurations"][0]["name"] = "other"
        self.assertError(self.put_nic(renamed), 400, "IpConfigDeleteNotSupported")

        dynamic = self.nic("nic-b")
        dynamic["properties"]["ipConfigurations"].append(
            {"name": "dyn", "properties": {"privateIPAllocationMethod": "Dynamic"}}
        )
        self.assertEqual(self.wait(self.put_nic(dynamic))["status"], "Succeeded")
        got = {c["name"]: c["properties"] for c in self.nic("nic-b")["properties"]["ipConfigurations"]}
        self.assertEqual(got["dyn"]["privateIPAddress"], "198.18.1.6", "the lowest free address after .4 and .5")

        broadcast = {"name": "ipconfig1", "subnet": "vnet/gateways", "privateIPAddress": "198.18.1.255"}
        nic_c = {"resourceGroup": "egret", "name": "nic-c", "ipConfigurations": [broadcast]}
        bad_seed = call(self.server.url, "POST", "/_emulator/seed", {"networkInterfaces": [nic_c]}, token=None)
        self.assertError(bad_seed, 400, "PrivateIPAddressInReservedRange")
        # A /29 has three addresses Azure hands out.
        tiny = {"resourceGroup": "egret", "name": "tiny", "subnets": [{"name": "s", "addressPrefix": "198.18.3.0/29"}]}
        dyn = [{"name": f"c{i}", "subnet": "tiny/s", "primary": i == 0} for i in range(4)]
        nic_d = {"resourceGroup": "egret", "name": "d", "ipConfigurations": dyn}
        full = {"virtualNetworks": [tiny], "networkInterfaces": [nic_d]}
        self.assertError(call(self.server.url, "POST", "/_emulator/seed", full, token=None), 400, "SubnetIsFull")
        dyn.pop()
        made = self.control("POST", "seed", full)  # the refused seed left nothing behind
        private = self.routing()["privateIPAddresses"]
        got = sorted(a for a, r in private.items() if r["networkInterface"] == made["networkInterfaces"]["d"])
        self.assertEqual(got, ["198.18.3.4", "198.18.3.5", "198.18.3.6"])

    def test_a_dynamic_ip_configuration_gets_a_free_address_of_its_subnet(self):
        # What the provider's add_address sends for a worker Node: one more IP
        # configuration, Dynamic, in the subnet of the NIC's primary one (here
        # "other", where nic-a2 holds .4). Azure "assigns the next available
        # unassigned or unreserved IP address in the subnet's address range"
        # (Microsoft Learn, "Allocate or assign private IP addresses",
        # https://learn.microsoft.com/training/modules/configure-virtual-networks/8-associate-private-ip-addresses):
        # not one another NIC holds, nor one an update still running asks for.
        other = f"{NET}/virtualNetworks/vnet/subnets/other"
        worker = {"resourceGroup": "egret", "name": "worker-nic",
                  "ipConfigurations": [{"name": "ipconfig1", "subnet": "vnet/other", "primary": True}]}
        self.control("POST", "seed", {"networkInterfaces": [worker]})
        self.assertEqual(self.routing()["privateIPAddresses"]["198.18.2.5"]["ipConfiguration"],
                         ipconfig("worker-nic", "ipconfig1"))
        self.control("PUT", "config", {"asyncDelay": 1.0})
        running = self.nic("worker-nic")
        running["properties"]["ipConfigurations"].append(
            {"name": "static", "properties": {"privateIPAddress": "198.18.2.6", "subnet": {"id": other}}}
        )
        running_reply = self.put_nic(running)
        self.assertEqual(running_reply.status, 200, running_reply.body)

        node = self.nic("nic-a2")
        node["properties"]["ipConfigurations"].append(
            {"name": "egret-node-1", "properties": {"privateIPAllocationMethod": "Dynamic", "primary": False,
                                                    "privateIPAddressVersion": "IPv4", "subnet": {"id": other}}}
        )
        self.assertEqual(self.wait(self.put_nic(node, headers={"If-Match": node["etag"]}))["status"], "Succeeded")
        got = {c["name"]: c["properties"] for c in self.nic("nic-a2")["properties"]["ipConfigurations"]}
        self.assertEqual(got["egret-node-1"]["privateIPAddress"], "198.18.2.7", "after .4, .5 and the running .6")
        self.assertEqual(got["egret-node-1"]["privateIPAllocationMethod"], "Dynamic")
        self.assertEqual(got["egret-node-1"]["subnet"]["id"], other)
        self.assertEqual(self.wait(running_reply)["status"], "Succeeded")

        # Put back as read: the address stays; made Static with it: it stays.
        again = self.nic("nic-a2")
        self.assertEqual(self.wait(self.put_nic(again))["status"], "Succeeded")
        pinned = self.nic("nic-a2")
        for c in pinned["properties"]["ipConfigurations"]:
            if c["name"] == "egret-node-1":
                c["properties"]["privateIPAllocationMethod"] = "Static"
                c["properties"]["publicIPAddress"] = {"id": f"{NET}/publicIPAddresses/egress-2"}
        self.assertEqual(self.wait(self.put_nic(pinned))["status"], "Succeeded")
        got = {c["name"]: c["properties"] for c in self.nic("nic-a2")["properties"]["ipConfigurations"]}
        self.assertEqual(
            (got["egret-node-1"]["privateIPAddress"], got["egret-node-1"]["privateIPAllocationMethod"]),
            ("198.18.2.7", "Static"),
        )
        route = self.routing()["privateIPAddresses"]["198.18.2.7"]
        self.assertEqual((route["ipConfiguration"], route["publicIPAddress"]),
                         (ipconfig("nic-a2", "egret-node-1"), "203.0.113.11"))

    # ------------------------------------------------ the front door rules ---

    def test_authentication_and_api_version_are_required(self):
        path = f"{NET}/networkInterfaces/nic-a"
        missing = self.arm("GET", f"{path}?{NETWORK_API}", token=None)
        self.assertError(missing, 401, "AuthenticationFailed")
        self.assertTrue(missing.headers["WWW-Authenticate"].startswith("Bearer "))
        basic = self.arm("GET", f"{path}?{NETWORK_API}", token=None, headers={"Authorization": "Basic eDp5"})
        self.assertError(basic, 401, "AuthenticationFailedInvalidHeader")
        self.control("PUT", "config", {"tokens": ["good"]})
        self.assertError(self.arm("GET", f"{path}?{NETWORK_API}", token="bad"), 401, "InvalidAuthenticationToken")
        self.assertEqual(self.arm("GET", f"{path}?{NETWORK_API}", token="good").status, 200)

        self.assertError(self.arm("GET", path, token="good"), 400, "MissingApiVersionParameter")
        self.assertError(self.arm("GET", f"{path}?api-version=latest", token="good"), 400, "InvalidApiVersionParameter")
        older = self.arm("GET", f"{path}?api-version=2023-09-01", token="good")
        self.assertError(older, 400, "NoRegisteredProviderFound")
        self.assertError(self.arm("GET", resources(api="2024-05-01"), token="good"), 400, "InvalidApiVersionParameter")
        self.assertError(self.arm("GET", resources(sub="nope"), token="good"), 404, "SubscriptionNotFound")

    def test_entra_token_endpoint_issues_the_tokens_arm_accepts(self):
        tenant = "72f988bf-86f1-41af-91ab-2d7cd011db47"
        form = (
            "client_assertion=the-service-account-token&client_assertion_type="
            + quote(emulator.ASSERTION_TYPE, safe="")
            + "&client_id=cid&grant_type=client_credentials&scope="
            + quote(self.server.url + "/.default", safe="")
        )
        req = urllib.request.Request(
            f"{self.server.url}/{tenant}/oauth2/v2.0/token",
            data=form.encode(),
            method="POST",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            answer = json.loads(r.read())
        self.assertEqual((answer["token_type"], answer["expires_in"]), ("Bearer", 3599))
        logged = self.control("GET", "tokens")[-1]
        self.assertEqual((logged["tenant"], logged["clientId"], logged["assertion"]), (tenant, "cid", "the-service-account-token"))
        bad = urllib.request.Request(f"{self.server.url}/{tenant}/oauth2/v2.0/token", data=b"client_id=cid", method="POST")
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bad, timeout=10)
        self.assertEqual(e.exception.code, 400)
        self.assertEqual(json.loads(e.exception.read())["error_codes"], [900144])
        path = f"{NET}/networkInterfaces/nic-a?{NETWORK_API}"
        self.control("PUT", "config", {"requireIssuedTokens": True, "tokens": ["lab-admin"]})
        self.assertError(self.arm("GET", path, token="anything"), 401, "InvalidAuthenticationToken")
        self.assertEqual(self.arm("GET", path, token=answer["access_token"]).status, 200)
        self.assertEqual(self.arm("GET", path, token="lab-admin").status, 200)

    def test_tags_control_call_retags_a_public_ip(self):
        pip = self.ids["publicIPAddresses"]["egress-1"]
        self.control("PUT", "tags", {"id": pip, "tags": {"egret-pool": "retired"}})
        got = self.arm("GET", f"{NET}/publicIPAddresses/egress-1?{NETWORK_API}")
        self.assertEqual(got.body["tags"], {"egret-pool": "retired"})

    def test_throttling_answers_429_with_retry_after_per_principal(self):
        # One token a second: the three reads below must come within a second
        # (at 20 a second, a read 50 ms late on a busy machine found a token
        # refilled and the test failed in CI's run beside the lab).
        self.control("PUT", "config", {"readBucket": 3, "readRefill": 1, "writeBucket": 1, "writeRefill": 0.5})
        path = f"{NET}/networkInterfaces/nic-a?{NETWORK_API}"
        remaining = [self.arm("GET", path).headers["x-ms-ratelimit-remaining-subscription-reads"] for _ in range(3)]
        self.assertEqual(remaining, ["2", "1", "0"])
        throttled = self.arm("GET", path)
        self.assertError(throttled, 429, "SubscriptionRequestsThrottled")
        self.assertEqual(throttled.headers["Retry-After"], "1")
        self.assertEqual(throttled.headers["x-ms-ratelimit-remaining-subscription-reads"], "0")
        self.assertEqual(self.arm("GET", path, token="another-principal").status, 200)
        time.sleep(1.05)  # a token at 1 per second
        self.assertEqual(self.arm("GET", path).status, 200)

        # The writer reads the NIC itself: the default principal's reads
        # are spent again.
        got = self.arm("GET", f"{NET}/networkInterfaces/nic-b?{NETWORK_API}", token="writer")
        self.assertEqual(got.status, 200, got.body)
        nic = got.body
        first = self.put_nic(nic, token="writer")
        self.assertEqual(first.headers["x-ms-ratelimit-remaining-subscription-writes"], "0")
        second = self.put_nic(nic, token="writer")
        self.assertError(second, 429, "SubscriptionRequestsThrottled")
        self.assertEqual(second.headers["Retry-After"], "2", "one token at 0.5 per second")

    def test_faults_answer_errors_a_number_of_times_or_stall(self):
        fault = {"method": "GET", "path": "*/networkinterfaces/nic-a", "times": 2}
        self.control("POST", "faults", {**fault, "status": 503, "code": "ServiceUnavailable", "retryAfter": 3})
        path = f"{NET}/networkInterfaces/nic-a?{NETWORK_API}"
        for _ in range(2):
            failed = self.arm("GET", path)
            self.assertError(failed, 503, "ServiceUnavailable")
            self.assertEqual(failed.headers["Retry-After"], "3")
        self.assertEqual(self.arm("GET", path).status, 200)
        self.assertEqual(self.control("GET", "faults"), [])

        self.control("POST", "faults", {"path": "*/virtualMachines/*", "stall": 0.3})
        t0 = time.monotonic()
        self.assertEqual(self.arm("GET", VM_GW_A).status, 200)
        self.assertGreaterEqual(time.monotonic() - t0, 0.3)

    def test_stale_reads_lag_the_commits(self):
        self.control("PUT", "config", {"staleness": 0.4, "asyncDelay": 0.05})
        done = self.wait(self.put_nic(self.without(self.nic("nic-a"), "egress-1")))
        self.assertEqual(done["status"], "Succeeded")
        t_commit = time.monotonic()
        self.assertEqual(len(self.nic("nic-a")["properties"]["ipConfigurations"]), 2, "a stale read still shows it")
        pip = self.arm("GET", f"{NET}/publicIPAddresses/egress-1?{NETWORK_API}").body
        self.assertIn("ipConfiguration", pip["properties"])
        self.assertIsNone(self.routing()["publicIPAddresses"]["203.0.113.10"]["networkInterface"], "routing is current")
        subnet = self.arm("GET", f"{NET}/virtualNetworks/vnet/subnets/gateways?{NETWORK_API}").body
        self.assertEqual(len(subnet["properties"]["ipConfigurations"]), 2, "subnet reads are current")
        time.sleep(max(0.0, t_commit + 0.45 - time.monotonic()))
        self.assertEqual(len(self.nic("nic-a")["properties"]["ipConfigurations"]), 1)
        pip = self.arm("GET", f"{NET}/publicIPAddresses/egress-1?{NETWORK_API}").body
        self.assertNotIn("ipConfiguration", pip["properties"])

    def test_the_request_log_shows_what_was_sent(self):
        self.control("DELETE", "requests")
        nic = self.nic("nic-b")
        self.put_nic(nic, headers={"If-Match": nic["etag"]})
        log = self.control("GET", "requests")
        self.assertEqual([(e["method"], e["status"]) for e in log], [("GET", 200), ("PUT", 200)])
        put = log[1]
        self.assertEqual(put["path"], f"{NET}/networkInterfaces/nic-b")
        self.assertEqual(put["query"], {"api-version": "2024-05-01"})
        self.assertEqual(put["headers"]["If-Match"], nic["etag"])
        self.assertEqual(put["headers"]["Authorization"], "<redacted>")
        self.assertEqual(put["body"], nic)
        self.assertLessEqual(log[0]["time"], put["time"])
        self.control("DELETE", "requests")
        self.assertEqual(self.control("GET", "requests"), [])


def make_test_ca(directory: Path) -> None:
    """A CA and a server certificate for 127.0.0.1 made with openssl, as
    tests/src/moto.rs's TestCa makes them: ca.pem, server.pem, server.key."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    ca = ["-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=Egret test CA"]
    ca += ["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"]
    openssl("req", "-x509", *ec, *ca)
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=arm-emulator")
    ext = "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n"
    (directory / "server.ext").write_text(ext)
    sign = ["-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2"]
    openssl("x509", "-req", *sign, "-out", "server.pem", "-extfile", "server.ext")


class HttpsTest(unittest.TestCase):
    """The emulator over HTTPS, in this process and through azure-emulator.sh."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = tempfile.TemporaryDirectory(prefix="egret-azure-emu-test-")
        cls.ca_dir = Path(cls.tmp.name) / "ca"
        cls.ca_dir.mkdir()
        make_test_ca(cls.ca_dir)
        cls.trust = ssl.create_default_context(cafile=str(cls.ca_dir / "ca.pem"))

    @classmethod
    def tearDownClass(cls) -> None:
        cls.tmp.cleanup()

    def test_served_over_https_only(self):
        server = emulator.Server(("127.0.0.1", 0), emulator.tls_context(self.ca_dir))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            self.assertTrue(server.url.startswith("https://"))
            reply = call(server.url, "GET", "/_emulator/health", token=None, context=self.trust)
            self.assertEqual((reply.status, reply.body), (200, {"status": "ok"}))
            with self.assertRaises((urllib.error.URLError, ConnectionError)):
                call(server.url.replace("https://", "http://"), "GET", "/_emulator/health", token=None)
            with self.assertRaises(urllib.error.URLError):
                call(server.url, "GET", "/_emulator/health", token=None, context=ssl.create_default_context())
        finally:
            server.shutdown()
            server.server_close()

    def test_the_script_starts_reports_and_stops_it(self):
        script = HERE / "azure-emulator.sh"
        state = Path(self.tmp.name) / "state"
        env = dict(
            os.environ,
            EGRET_AZURE_EMU_STATE=str(state),
            EGRET_AZURE_EMU_OWNER_PID=str(os.getpid()),
            EGRET_AZURE_EMU_TLS_DIR=str(self.ca_dir),
        )

        def run(command: str) -> subprocess.CompletedProcess:
            return subprocess.run([str(script), command], env=env, capture_output=True, text=True, timeout=60)

        started = run("start")
        try:
            self.assertEqual(started.returncode, 0, started.stderr)
            url = started.stdout.strip().splitlines()[-1]
            self.assertRegex(url, r"^https://127\.0\.0\.1:\d+$")
            self.assertEqual(call(url, "GET", "/_emulator/health", token=None, context=self.trust).status, 200)
            self.assertEqual(run("status").returncode, 0)
            self.assertEqual(
                run("env").stdout.splitlines(),
                [f"EGRET_AZURE_EMULATOR_URL={url}", f"EGRET_AZURE_EMULATOR_CA={self.ca_dir}/ca.pem"],
            )
        finally:
            stopped = run("stop")
        self.assertEqual(stopped.returncode, 0, stopped.stderr)
        self.assertEqual(run("status").returncode, 3)
        self.assertFalse(state.exists())


if __name__ == "__main__":
    unittest.main()
