#!/usr/bin/env bash
# Provisions the lab's gateway VM (vagrant/Vagrantfile), as root inside it:
# the node image's own configuration files, as its config drive would write
# them (deploy/images/node/README.md, "First-boot configuration"), then its
# own units restarted. Nothing is installed or built: egret is the image's.
#
#   provision-gateway.sh INSIDE_MAC OUTSIDE_MAC
#
# Safe to run again (`vagrant provision gateway`).
set -euo pipefail
inside_mac=$1 outside_mac=$2

# The NIC that has a MAC (names follow PCI order; the MACs are fixed).
nic() {
  local f
  for f in /sys/class/net/*/address; do
    if [[ $(cat "$f") == "$1" ]]; then
      basename "$(dirname "$f")"
      return 0
    fi
  done
  echo "provision-gateway: no NIC with MAC $1" >&2
  return 1
}
inside=$(nic "$inside_mac")
outside=$(nic "$outside_mac")
echo "provision-gateway: inside $inside ($inside_mac), outside $outside ($outside_mac)"

# Addresses and routes (docs/lab.md's gateway): systemd-networkd, by MAC.
# The pods' prefixes are routed to the node router, the server's to the
# upstream router; the egress IPs are not on any interface (Egret answers
# ARP/NDP for them on the outside link).
cat >/etc/systemd/network/20-egret-lab-inside.network <<EOF
# Written by Egret's vagrant/guest/provision-gateway.sh: the lab's inside link.
[Match]
MACAddress=$inside_mac

[Link]
RequiredForOnline=no

[Network]
Address=192.0.2.2/24
Address=2001:db8:2::2/64
LinkLocalAddressing=ipv6
IPv6AcceptRA=no

[Route]
Destination=198.18.0.0/16
Gateway=192.0.2.1

[Route]
Destination=2001:db8:18::/48
Gateway=2001:db8:2::1
EOF
cat >/etc/systemd/network/20-egret-lab-outside.network <<EOF
# Written by Egret's vagrant/guest/provision-gateway.sh: the lab's outside link.
[Match]
MACAddress=$outside_mac

[Link]
RequiredForOnline=no

[Network]
Address=203.0.113.2/24
Address=2001:db8:113::2/64
LinkLocalAddressing=ipv6
IPv6AcceptRA=no

[Route]
Destination=198.51.100.0/24
Gateway=203.0.113.1

[Route]
Destination=2001:db8:51::/64
Gateway=2001:db8:113::1
EOF

# The boot table's settings: pod sources arriving on the inside link are
# dropped until egret runs.
mkdir -p /etc/egret
cat >/etc/egret/node.conf <<EOF
# Written by Egret's vagrant/guest/provision-gateway.sh (the lab).
EGRET_POD_INTERFACES="$inside"
EGRET_POD_CIDRS="198.18.0.0/16 2001:db8:18::/48"
EGRET_KEEP_CIDRS=""
EGRET_READY_TIMEOUT="600"
EOF
# (EGRET_METRICS is left at its default, 127.0.0.1:9469, gateway.yaml's
# metrics.listen below.)

# The lab's gateway configuration (tests/src/gateway.rs, docs/config.md):
# policy "a" takes pods A and B (and the IPv6 pod) to everything but
# 198.51.100.128/25 via E1 / E6, policy "c" takes pod C to 198.51.100.0/24
# via E2; pod U has no policy. Normal priority: the VM has one emulated CPU.
cat >/etc/egret/gateway.yaml.new <<EOF
# Written by Egret's vagrant/guest/provision-gateway.sh: the lab's gateway.
interfaces:
  - name: $inside
    role: inside
  - name: $outside
    role: outside
xdp:
  mode: native
  fastPath: true
workers:
  realtimePriority: 0
egressIPs:
  - ip: 203.0.113.10
  - ip: 203.0.113.11
  - ip: 2001:db8:113::10
policies:
  - name: a
    sources: [198.18.0.0/24, 2001:db8:18::/64]
    destinations: [0.0.0.0/0, ::/0]
    except: [198.51.100.128/25]
    egressIPs: [203.0.113.10, 2001:db8:113::10]
  - name: c
    sources: [198.18.1.0/24]
    destinations: [198.51.100.0/24]
    egressIPs: [203.0.113.11]
admin:
  socket: /run/egret/egret.sock
metrics:
  listen: 127.0.0.1:9469
EOF
egret check-config /etc/egret/gateway.yaml.new
mv /etc/egret/gateway.yaml.new /etc/egret/gateway.yaml

# The boot table again with the new node.conf (systemd-networkd requires it
# and restarts with it, taking the new links), then egret.
systemctl restart egret-failclosed-boot.service
systemctl enable egret.service
systemctl restart egret.service

# egret's /ready waits for its next hops (the client VM's routers); it asks
# the kernel again for any it gave up on (FAILED), so a client VM that boots
# late is found once it answers.
ready() {
  exec 3<>/dev/tcp/127.0.0.1/9469 || return 1
  printf 'GET /ready HTTP/1.0\r\n\r\n' >&3
  local status
  read -r _ status _ <&3
  exec 3<&-
  [[ $status == 200 ]]
}
for i in $(seq 600); do
  if ready 2>/dev/null; then
    echo "provision-gateway: egret is ready"
    egret status --socket /run/egret/egret.sock || true
    exit 0
  fi
  sleep 1
done
echo "provision-gateway: egret not ready after 600 s (is the client VM up?)" >&2
ip neigh show >&2 || true
systemctl status egret.service --no-pager >&2 || true
journalctl -u egret.service -n 40 --no-pager >&2 || true
exit 1
