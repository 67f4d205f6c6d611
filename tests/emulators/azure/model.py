"""The emulator's resources, the rules a network interface update must pass,
and the ARM JSON each resource is rendered as.

Only what the emulated calls read or write is kept: subscriptions and resource
groups, virtual networks and their subnets, public IP addresses, network
interfaces with their IP configurations, and virtual machines with their
network interfaces. A public IP's association and a subnet's list of IP
configurations are not stored: they are derived from the network interfaces,
so the two sides can never disagree. ARM compares resource IDs without regard
to case; the maps here are keyed by the lower-cased ID (`key`) and keep the ID
as first spelled for output.

README.md names the reference page each rendering and each error follows.
"""

from __future__ import annotations

import ipaddress
import random
import uuid
from dataclasses import dataclass, field

RESOURCES_API = "2021-04-01"
NETWORK_API = "2024-05-01"
COMPUTE_API = "2024-07-01"

PUBLIC_IP = "Microsoft.Network/publicIPAddresses"
NIC = "Microsoft.Network/networkInterfaces"
VNET = "Microsoft.Network/virtualNetworks"
VM = "Microsoft.Compute/virtualMachines"

DEFAULT_SUBSCRIPTION = "00000000-0000-4000-8000-000000000001"
DEFAULT_LOCATION = "westeurope"


class ArmError(Exception):
    """An answer in ARM's common error shape: `{"error": {"code", "message"}}`."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}


def key(arm_id: str) -> str:
    return arm_id.lower()


def name_of(arm_id: str) -> str:
    return arm_id.rstrip("/").rsplit("/", 1)[1]


def group_id(sub: str, group: str) -> str:
    return f"/subscriptions/{sub}/resourceGroups/{group}"


def resource_id(sub: str, group: str, rtype: str, name: str) -> str:
    return f"{group_id(sub, group)}/providers/{rtype}/{name}"


def new_etag() -> str:
    return f'W/"{uuid.uuid4()}"'


def new_mac() -> str:
    return "00-0D-3A-" + "-".join(f"{random.randrange(256):02X}" for _ in range(3))


def not_found(rtype: str, name: str, group: str) -> ArmError:
    return ArmError(
        404,
        "ResourceNotFound",
        f"The Resource '{rtype}/{name}' under resource group '{group}' was not found. "
        "For more details please go to https://aka.ms/ARMResourceNotFoundFix",
    )


def bad_request(message: str) -> ArmError:
    return ArmError(400, "InvalidRequestFormat", message)


@dataclass
class PublicIp:
    id: str
    location: str
    address: str
    tags: dict[str, str]
    etag: str = field(default_factory=new_etag)
    guid: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass
class IpConfig:
    name: str
    address: str
    allocation: str  # "Static" or "Dynamic"
    subnet_id: str
    primary: bool
    public_ip_id: str | None


@dataclass
class Nic:
    id: str
    location: str
    ip_configs: list[IpConfig]
    forwarding: bool
    tags: dict[str, str]
    etag: str = field(default_factory=new_etag)
    guid: str = field(default_factory=lambda: str(uuid.uuid4()))
    mac: str = field(default_factory=new_mac)
    vm_id: str | None = None
    # "Succeeded", "Updating" while an update runs, "Failed" after one failed.
    state: str = "Succeeded"

    def ipconfig_id(self, name: str) -> str:
        return f"{self.id}/ipConfigurations/{name}"


@dataclass
class Subnet:
    id: str
    prefix: ipaddress.IPv4Network
    etag: str = field(default_factory=new_etag)

    def reserved(self) -> set[ipaddress.IPv4Address]:
        """The first four addresses and the last one, which Azure keeps (VNet FAQ)."""
        net = self.prefix
        return {net.network_address + i for i in range(4)} | {net.broadcast_address}


@dataclass
class VNet:
    id: str
    location: str
    tags: dict[str, str]


@dataclass
class Vm:
    id: str
    location: str
    nic_ids: list[str]  # the first is the primary interface
    tags: dict[str, str]
    uuid: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass
class World:
    """Everything committed, at one instant (deep-copied for stale reads)."""

    subscriptions: set[str] = field(default_factory=set)
    groups: dict[str, str] = field(default_factory=dict)
    vnets: dict[str, VNet] = field(default_factory=dict)
    subnets: dict[str, Subnet] = field(default_factory=dict)
    public_ips: dict[str, PublicIp] = field(default_factory=dict)
    nics: dict[str, Nic] = field(default_factory=dict)
    vms: dict[str, Vm] = field(default_factory=dict)

    def require_group(self, sub: str, group: str) -> None:
        if sub.lower() not in self.subscriptions:
            raise ArmError(404, "SubscriptionNotFound", f"The subscription '{sub}' could not be found.")
        if key(group_id(sub, group)) not in self.groups:
            raise ArmError(404, "ResourceGroupNotFound", f"Resource group '{group}' could not be found.")

    def association(self, pip_id: str) -> tuple[Nic, IpConfig] | None:
        """The NIC and IP configuration that reference a public IP, if any."""
        for nic in self.nics.values():
            for ipc in nic.ip_configs:
                if ipc.public_ip_id is not None and key(ipc.public_ip_id) == key(pip_id):
                    return nic, ipc
        return None

    def resources(self) -> list[tuple[str, str, str, dict[str, str]]]:
        """(id, type, location, tags) of every resource, for Resources - List."""
        out = [(v.id, VNET, v.location, v.tags) for v in self.vnets.values()]
        out += [(p.id, PUBLIC_IP, p.location, p.tags) for p in self.public_ips.values()]
        out += [(n.id, NIC, n.location, n.tags) for n in self.nics.values()]
        out += [(m.id, VM, m.location, m.tags) for m in self.vms.values()]
        return sorted(out, key=lambda r: key(r[0]))


# ------------------------------------------------------------ NIC updates ---


def parse_nic(body: object, nic_id: str, existing: Nic | None) -> Nic:
    """A NIC from a PUT body (the whole resource: a PUT replaces it)."""
    if not isinstance(body, dict) or not isinstance(body.get("properties"), dict):
        raise bad_request("The request body must be a network interface with 'properties'.")
    props = body["properties"]
    location = body.get("location") or (existing.location if existing else None)
    if not location:
        raise ArmError(400, "LocationRequired", "The location property is required for this definition.")
    raw = props.get("ipConfigurations")
    if not isinstance(raw, list) or not raw:
        raise bad_request(f"Network interface {nic_id} must have at least one IP configuration.")
    previous = {c.name.lower(): c for c in existing.ip_configs} if existing else {}
    configs = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise bad_request("Every IP configuration needs a 'name'.")
        p = item.get("properties") or {}
        if p.get("privateIPAddressVersion", "IPv4") != "IPv4":
            raise bad_request("The emulator serves IPv4 IP configurations only.")
        address = p.get("privateIPAddress")
        allocation = p.get("privateIPAllocationMethod") or ("Static" if address else "Dynamic")
        if allocation not in ("Static", "Dynamic"):
            raise bad_request(f"privateIPAllocationMethod '{allocation}' is not Static or Dynamic.")
        if allocation == "Dynamic" and not address:
            # A dynamic address stays with its IP configuration across updates.
            kept = previous.get(item["name"].lower())
            address = kept.address if kept else ""
        configs.append(
            IpConfig(
                name=item["name"],
                address=address or "",
                allocation=allocation,
                subnet_id=(p.get("subnet") or {}).get("id") or "",
                primary=bool(p.get("primary", False)),
                public_ip_id=(p.get("publicIPAddress") or {}).get("id"),
            )
        )
    names = [c.name.lower() for c in configs]
    if len(set(names)) != len(names):
        raise bad_request(f"Network interface {nic_id} has two IP configurations with one name.")
    return Nic(
        id=existing.id if existing else nic_id,
        location=location,
        ip_configs=configs,
        forwarding=bool(props.get("enableIPForwarding", False)),
        tags=dict(body.get("tags") or {}),
        guid=existing.guid if existing else str(uuid.uuid4()),
        mac=existing.mac if existing else new_mac(),
        vm_id=existing.vm_id if existing else None,
    )


def check_nic(world: World, nic: Nic, existing: Nic | None, pending: list[Nic]) -> None:
    """Validates `nic` (replacing `existing`) as the network resource provider
    does, against the committed NICs and the NICs of updates still running
    (`pending`): raises ArmError, or fills in dynamic addresses and returns."""
    configs = nic.ip_configs
    primaries = [c for c in configs if c.primary]
    if len(configs) == 1 and not primaries:
        configs[0].primary = True
        primaries = configs
    if len(primaries) != 1:
        what = "none of the IPConfigurations is" if not primaries else "more than one of the IPConfigurations is"
        raise ArmError(
            400,
            "NetworkInterfaceMustHaveOneOneIPConfigAsPrimary",
            f"Network Interface {nic.id} specifies multiple IPConfigurations but {what} specified as Primary.",
        )
    if existing:
        old = next(c for c in existing.ip_configs if c.primary)
        if old.name.lower() != primaries[0].name.lower():
            raise ArmError(
                400,
                "IpConfigDeleteNotSupported",
                f"IP Configuration {old.name} cannot be deleted. "
                "Deletion and renaming of primary IP Configuration is not supported",
            )

    others = [n for n in world.nics.values() if key(n.id) != key(nic.id)]
    others += [n for n in pending if key(n.id) != key(nic.id)]
    taken_private = {c.address: n.ipconfig_id(c.name) for n in others for c in n.ip_configs}
    taken_public = {key(c.public_ip_id): n.ipconfig_id(c.name) for n in others for c in n.ip_configs if c.public_ip_id}

    for c in configs:
        if not c.subnet_id:
            c.subnet_id = primaries[0].subnet_id
        subnet = world.subnets.get(key(c.subnet_id))
        if subnet is None:
            raise invalid_reference(c.subnet_id or "(no subnet)", nic.id)
        c.subnet_id = subnet.id
    # Addresses asked for (or kept) first, so that a new dynamic one never
    # takes an address another IP configuration of this update asks for.
    mine: dict[str, str] = {}
    for c in sorted(configs, key=lambda c: not c.address):
        subnet = world.subnets[key(c.subnet_id)]
        ipc_id = nic.ipconfig_id(c.name)
        if not c.address:
            if c.allocation == "Static":
                raise bad_request(f"IP configuration {ipc_id} is Static but has no privateIPAddress.")
            c.address = free_address(subnet, set(taken_private) | set(mine), nic.id)
        try:
            address = ipaddress.IPv4Address(c.address)
        except ValueError:
            raise bad_request(
                f"IP configuration {ipc_id} has the private IP address '{c.address}', not an IPv4 address."
            ) from None
        c.address = str(address)
        if address not in subnet.prefix:
            raise ArmError(
                400,
                "PrivateIPAddressNotInSubnet",
                f"IP configuration {ipc_id} is using the private IP address {address} "
                f"which is outside of the subnet {subnet.id} ({subnet.prefix}).",
            )
        if address in subnet.reserved():
            raise ArmError(
                400,
                "PrivateIPAddressInReservedRange",
                f"Private static IP address {address} falls within reserved IP range of subnet prefix {subnet.prefix}.",
            )
        holder = taken_private.get(c.address) or mine.get(c.address)
        if holder:
            raise ArmError(
                400,
                "PrivateIPAddressIsAllocated",
                f"IP configuration {ipc_id} is using the private IP address {address} "
                f"which is already allocated to resource {holder}.",
            )
        mine[c.address] = ipc_id

    referenced: dict[str, str] = {}
    for c in configs:
        if c.public_ip_id is None:
            continue
        pip = world.public_ips.get(key(c.public_ip_id))
        if pip is None:
            raise invalid_reference(c.public_ip_id, nic.id)
        c.public_ip_id = pip.id
        ipc_id = nic.ipconfig_id(c.name)
        holder = taken_public.get(key(pip.id)) or referenced.get(key(pip.id))
        if holder:
            raise ArmError(
                400,
                "PublicIPAddressInUse",
                f"Resource {ipc_id} is referencing public IP address {pip.id} "
                f"that is already allocated to resource {holder}.",
            )
        referenced[key(pip.id)] = ipc_id


def invalid_reference(ref: str, by: str) -> ArmError:
    return ArmError(
        400,
        "InvalidResourceReference",
        f"Resource {ref} referenced by resource {by} was not found. "
        "Please make sure that the referenced resource exists, and that both resources are in the same region.",
    )


def free_address(subnet: Subnet, taken: set[str], nic_id: str) -> str:
    """The lowest address of the subnet that is neither reserved nor taken."""
    reserved = subnet.reserved()
    for address in subnet.prefix:
        if address not in reserved and str(address) not in taken:
            return str(address)
    raise ArmError(
        400,
        "SubnetIsFull",
        f"Subnet {name_of(subnet.id)} with address prefix {subnet.prefix} doesn't have enough capacity for IP "
        f"addresses (network interface {nic_id}).",
    )


# -------------------------------------------------------------- rendering ---


def render_public_ip(world: World, pip: PublicIp) -> dict:
    props = {
        "provisioningState": "Succeeded",
        "resourceGuid": pip.guid,
        "ipAddress": pip.address,
        "publicIPAddressVersion": "IPv4",
        "publicIPAllocationMethod": "Static",
        "idleTimeoutInMinutes": 4,
        "ipTags": [],
    }
    assoc = world.association(pip.id)
    if assoc:
        nic, ipc = assoc
        props["ipConfiguration"] = {"id": nic.ipconfig_id(ipc.name)}
    return {
        "name": name_of(pip.id),
        "id": pip.id,
        "etag": pip.etag,
        "type": PUBLIC_IP,
        "location": pip.location,
        "tags": dict(pip.tags),
        "sku": {"name": "Standard", "tier": "Regional"},
        "properties": props,
    }


def render_nic(nic: Nic, state: str | None = None) -> dict:
    """A NIC as GET shows it; `state` overrides the provisioning state (a PUT's
    answer shows the requested NIC "Updating")."""
    state = state or nic.state
    configs = []
    for c in nic.ip_configs:
        props = {
            "provisioningState": state,
            "privateIPAddress": c.address,
            "privateIPAllocationMethod": c.allocation,
            "privateIPAddressVersion": "IPv4",
            "subnet": {"id": c.subnet_id},
            "primary": c.primary,
        }
        if c.public_ip_id:
            props["publicIPAddress"] = {"id": c.public_ip_id}
        configs.append(
            {
                "name": c.name,
                "id": nic.ipconfig_id(c.name),
                "etag": nic.etag,
                "type": f"{NIC}/ipConfigurations",
                "properties": props,
            }
        )
    props = {
        "provisioningState": state,
        "resourceGuid": nic.guid,
        "ipConfigurations": configs,
        "dnsSettings": {"dnsServers": [], "appliedDnsServers": []},
        "macAddress": nic.mac,
        "enableAcceleratedNetworking": False,
        "enableIPForwarding": nic.forwarding,
        "nicType": "Standard",
    }
    if nic.vm_id:
        props["virtualMachine"] = {"id": nic.vm_id}
    return {
        "name": name_of(nic.id),
        "id": nic.id,
        "etag": nic.etag,
        "type": NIC,
        "location": nic.location,
        "tags": dict(nic.tags),
        "properties": props,
    }


def render_subnet(world: World, subnet: Subnet) -> dict:
    ipcs = [
        {"id": n.ipconfig_id(c.name)}
        for n in world.nics.values()
        for c in n.ip_configs
        if key(c.subnet_id) == key(subnet.id)
    ]
    return {
        "name": name_of(subnet.id),
        "id": subnet.id,
        "etag": subnet.etag,
        "type": f"{VNET}/subnets",
        "properties": {
            "provisioningState": "Succeeded",
            "addressPrefix": str(subnet.prefix),
            "ipConfigurations": ipcs,
            "privateEndpointNetworkPolicies": "Disabled",
            "privateLinkServiceNetworkPolicies": "Enabled",
        },
    }


def render_vm(vm: Vm) -> dict:
    nics = [{"id": nic_id, "properties": {"primary": i == 0}} for i, nic_id in enumerate(vm.nic_ids)]
    return {
        "name": name_of(vm.id),
        "id": vm.id,
        "type": VM,
        "location": vm.location,
        "tags": dict(vm.tags),
        "properties": {
            "vmId": vm.uuid,
            "hardwareProfile": {"vmSize": "Standard_D2s_v5"},
            "networkProfile": {"networkInterfaces": nics},
            "provisioningState": "Succeeded",
        },
    }


def render_generic(arm_id: str, rtype: str, location: str, tags: dict[str, str] | None) -> dict:
    """A Resources - List row; `tags` None leaves them out (a tag filter does)."""
    row = {"id": arm_id, "name": name_of(arm_id), "type": rtype, "location": location}
    if rtype == PUBLIC_IP:
        row["sku"] = {"name": "Standard", "tier": "Regional"}
    if tags is not None:
        row["tags"] = dict(tags)
    return row


def routing(world: World) -> dict:
    """Where each address is now (committed): what a lab routes by."""
    vm_of = {key(nic_id): vm.id for vm in world.vms.values() for nic_id in vm.nic_ids}
    private = {}
    for nic in world.nics.values():
        for c in nic.ip_configs:
            pip = world.public_ips.get(key(c.public_ip_id)) if c.public_ip_id else None
            private[c.address] = {
                "networkInterface": nic.id,
                "ipConfiguration": nic.ipconfig_id(c.name),
                "virtualMachine": vm_of.get(key(nic.id)),
                "primary": c.primary,
                "publicIPAddress": pip.address if pip else None,
            }
    public = {}
    for pip in world.public_ips.values():
        assoc = world.association(pip.id)
        nic, ipc = assoc if assoc else (None, None)
        public[pip.address] = {
            "id": pip.id,
            "networkInterface": nic.id if nic else None,
            "ipConfiguration": nic.ipconfig_id(ipc.name) if nic else None,
            "virtualMachine": vm_of.get(key(nic.id)) if nic else None,
            "privateIPAddress": ipc.address if ipc else None,
        }
    return {"publicIPAddresses": public, "privateIPAddresses": private}


# ---------------------------------------------------------------- seeding ---


def seed(world: World, spec: object) -> dict:
    """Adds the resources `spec` describes (README.md, "Seeding") to `world`,
    checking NICs as a PUT would; returns the IDs made, by kind and name."""
    if not isinstance(spec, dict):
        raise seed_error("the seed must be a JSON object")
    sub = spec.get("subscriptionId", DEFAULT_SUBSCRIPTION)
    location = spec.get("location", DEFAULT_LOCATION)
    world.subscriptions.add(sub.lower())
    made: dict[str, dict[str, str]] = {"resourceGroups": {}, "subnets": {}}

    def group(item: dict) -> str:
        name = item.get("resourceGroup")
        if not isinstance(name, str) or not name:
            raise seed_error(f"{item!r} has no resourceGroup")
        gid = group_id(sub, name)
        world.groups.setdefault(key(gid), gid)
        made["resourceGroups"][name] = gid
        return name

    def named(item: object, what: str) -> dict:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise seed_error(f"a {what} needs a name: {item!r}")
        return item

    def ref(value: str, rtype: str, rg: str) -> str:
        return value if value.startswith("/") else resource_id(sub, rg, rtype, value)

    def add(table: dict, resource, what: str) -> None:
        if key(resource.id) in table:
            raise seed_error(f"{what} {resource.id} exists already")
        table[key(resource.id)] = resource

    for name in spec.get("resourceGroups", []):
        group({"resourceGroup": name})

    for item in spec.get("virtualNetworks", []):
        item = named(item, "virtual network")
        rg = group(item)
        vnet = VNet(
            id=resource_id(sub, rg, VNET, item["name"]),
            location=location,
            tags=dict(item.get("tags", {})),
        )
        add(world.vnets, vnet, "virtual network")
        for s in item.get("subnets", []):
            s = named(s, "subnet")
            try:
                prefix = ipaddress.IPv4Network(s.get("addressPrefix", ""))
            except ValueError as e:
                raise seed_error(f"subnet {s['name']}: {e}") from e
            subnet = Subnet(id=f"{vnet.id}/subnets/{s['name']}", prefix=prefix)
            add(world.subnets, subnet, "subnet")
            made["subnets"][f"{item['name']}/{s['name']}"] = subnet.id

    made["publicIPAddresses"] = {}
    for item in spec.get("publicIPAddresses", []):
        item = named(item, "public IP address")
        rg = group(item)
        try:
            address = str(ipaddress.IPv4Address(item.get("ipAddress", "")))
        except ValueError as e:
            raise seed_error(f"public IP {item['name']}: {e}") from e
        pip = PublicIp(
            id=resource_id(sub, rg, PUBLIC_IP, item["name"]),
            location=location,
            address=address,
            tags=dict(item.get("tags", {})),
        )
        add(world.public_ips, pip, "public IP address")
        made["publicIPAddresses"][item["name"]] = pip.id

    made["networkInterfaces"] = {}
    for item in spec.get("networkInterfaces", []):
        item = named(item, "network interface")
        rg = group(item)
        nic_id = resource_id(sub, rg, NIC, item["name"])
        configs = []
        for c in item.get("ipConfigurations", []):
            c = named(c, "IP configuration")
            props: dict = {"primary": bool(c.get("primary", False))}
            if c.get("subnet"):
                vnet, _, subnet = c["subnet"].partition("/")
                sid = f"{resource_id(sub, rg, VNET, vnet)}/subnets/{subnet}"
                props["subnet"] = {"id": c["subnet"] if c["subnet"].startswith("/") else sid}
            if c.get("privateIPAddress"):
                props["privateIPAddress"] = c["privateIPAddress"]
            if c.get("publicIPAddress"):
                props["publicIPAddress"] = {"id": ref(c["publicIPAddress"], PUBLIC_IP, rg)}
            configs.append({"name": c["name"], "properties": props})
        body = {
            "location": location,
            "tags": item.get("tags", {}),
            "properties": {
                "enableIPForwarding": bool(item.get("enableIPForwarding", False)),
                "ipConfigurations": configs,
            },
        }
        nic = parse_nic(body, nic_id, None)
        check_nic(world, nic, None, [])
        add(world.nics, nic, "network interface")
        made["networkInterfaces"][item["name"]] = nic.id

    made["virtualMachines"] = {}
    for item in spec.get("virtualMachines", []):
        item = named(item, "virtual machine")
        rg = group(item)
        vm = Vm(
            id=resource_id(sub, rg, VM, item["name"]),
            location=location,
            nic_ids=[],
            tags=dict(item.get("tags", {})),
        )
        for n in item.get("networkInterfaces", []):
            nic = world.nics.get(key(ref(n, NIC, rg)))
            if nic is None:
                raise seed_error(f"virtual machine {item['name']}: no network interface {n}")
            if nic.vm_id:
                raise seed_error(f"network interface {n} is already attached to {nic.vm_id}")
            nic.vm_id = vm.id
            vm.nic_ids.append(nic.id)
        add(world.vms, vm, "virtual machine")
        made["virtualMachines"][item["name"]] = vm.id
    return made


def seed_error(message: str) -> ArmError:
    return ArmError(400, "InvalidSeed", message)
