#!/usr/bin/env bash
# Provisions the lab's client VM (vagrant/Vagrantfile), as root inside it:
# docs/lab.md's pods, node router, upstream router and external server, in
# network namespaces named egret-vg-*, around the two links to the gateway
# VM, and the check command `egret-lab-check`.
#
#   provision-client.sh NODE_MAC UP_MAC
#
# NODE_MAC's NIC (the inside link) goes into the node router's namespace,
# UP_MAC's (the outside link) into the upstream router's. Safe to run again
# (`vagrant provision client`): the namespaces are rebuilt. Namespaces do
# not survive a reboot: after `vagrant reload`, run `vagrant provision`.
set -euo pipefail
node_mac=$1 up_mac=$2
P=egret-vg

# The NIC that has a MAC, in the root namespace or in one of ours.
nic() {
  local f
  for f in /sys/class/net/*/address; do
    if [[ $(cat "$f") == "$1" ]]; then
      basename "$(dirname "$f")"
      return 0
    fi
  done
  echo "provision-client: no NIC with MAC $1" >&2
  return 1
}

# Tear down an earlier run: the NICs fall back to the root namespace.
for ns in $(ip netns list | awk -v p="$P-" 'index($1, p) == 1 {print $1}'); do
  for pid in $(ip netns pids "$ns"); do kill -KILL "$pid" 2>/dev/null || true; done
  ip netns del "$ns"
done
for unit in $(systemctl list-units --all --plain --no-legend "$P-*" | awk '{print $1}'); do
  systemctl stop "$unit" 2>/dev/null || true
  systemctl reset-failed "$unit" 2>/dev/null || true
done
# A moved NIC takes a moment to reappear in the root namespace.
for _ in $(seq 50); do
  nic "$node_mac" >/dev/null 2>&1 && nic "$up_mac" >/dev/null 2>&1 && break
  sleep 0.1
done
node_if=$(nic "$node_mac")
up_if=$(nic "$up_mac")
echo "provision-client: inside link $node_if ($node_mac), outside link $up_if ($up_mac)"

in_ns() { local ns=$1; shift; ip netns exec "$P-$ns" "$@"; }
for ns in node up srv pod-a pod-b pod-c pod-u pod-v6; do
  ip netns add "$P-$ns"
  ip -n "$P-$ns" link set lo up
done

# Node router: the inside link, the pods' bridge, default route to the
# gateway.
ip link set "$node_if" netns "$P-node"
ip -n "$P-node" link set "$node_if" name gw
ip -n "$P-node" addr add 192.0.2.1/24 dev gw
ip -n "$P-node" addr add 2001:db8:2::1/64 dev gw nodad
ip -n "$P-node" link set gw up
ip -n "$P-node" link add pods type bridge
for a in 198.18.0.1/24 198.18.1.1/24 198.18.2.1/24; do ip -n "$P-node" addr add "$a" dev pods; done
ip -n "$P-node" addr add 2001:db8:18::1/64 dev pods nodad
ip -n "$P-node" link set pods up
ip -n "$P-node" route add default via 192.0.2.2
ip -n "$P-node" -6 route add default via 2001:db8:2::2
in_ns node sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1

# Pods: one veth each into the bridge.
pod() { # name v4addr|- v6addr|-
  local name=$1 v4=$2 v6=$3
  ip -n "$P-node" link add "p-$name" type veth peer name eth0 netns "$P-pod-$name"
  ip -n "$P-node" link set "p-$name" master pods up
  ip -n "$P-pod-$name" link set eth0 up
  if [[ $v4 != - ]]; then
    ip -n "$P-pod-$name" addr add "$v4" dev eth0
    ip -n "$P-pod-$name" route add default via "${v4%.*}.1"
  fi
  if [[ $v6 != - ]]; then
    ip -n "$P-pod-$name" addr add "$v6" dev eth0 nodad
    ip -n "$P-pod-$name" -6 route add default via 2001:db8:18::1
  fi
}
pod a 198.18.0.10/24 -
pod b 198.18.0.11/24 -
pod c 198.18.1.10/24 -
pod u 198.18.2.10/24 -
pod v6 - 2001:db8:18::10/64

# Upstream router: the outside link (the egress IPs are on-link there:
# Egret answers ARP/NDP for them), the server's link, routes back to the
# pods and the node router through the gateway.
ip link set "$up_if" netns "$P-up"
ip -n "$P-up" link set "$up_if" name gw
ip -n "$P-up" addr add 203.0.113.1/24 dev gw
ip -n "$P-up" addr add 2001:db8:113::1/64 dev gw nodad
ip -n "$P-up" link set gw up
ip -n "$P-up" link add srv type veth peer name eth0 netns "$P-srv"
ip -n "$P-up" addr add 198.51.100.1/24 dev srv
ip -n "$P-up" addr add 2001:db8:51::1/64 dev srv nodad
ip -n "$P-up" link set srv up
ip -n "$P-up" route add 198.18.0.0/16 via 203.0.113.2
ip -n "$P-up" route add 192.0.2.0/24 via 203.0.113.2
ip -n "$P-up" -6 route add 2001:db8:18::/48 via 2001:db8:113::2
ip -n "$P-up" -6 route add 2001:db8:2::/64 via 2001:db8:113::2
in_ns up sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1

# External server: SERVER .7, EXCLUDED .200, SERVER6; it answers each TCP
# connection on port 80 with the source address and port it saw.
ip -n "$P-srv" addr add 198.51.100.7/24 dev eth0
ip -n "$P-srv" addr add 198.51.100.200/24 dev eth0
ip -n "$P-srv" addr add 2001:db8:51::7/64 dev eth0 nodad
ip -n "$P-srv" link set eth0 up
ip -n "$P-srv" route add default via 198.51.100.1
ip -n "$P-srv" -6 route add default via 2001:db8:51::1
# shellcheck disable=SC2016 # $SOCAT_PEER* are expanded by the shell socat starts
reply='echo "saw $SOCAT_PEERADDR $SOCAT_PEERPORT"'
systemd-run --quiet --unit "$P-srv4" ip netns exec "$P-srv" \
  socat TCP4-LISTEN:80,fork,reuseaddr SYSTEM:"$reply"
systemd-run --quiet --unit "$P-srv6" ip netns exec "$P-srv" \
  socat TCP6-LISTEN:80,fork,reuseaddr,ipv6only=1 SYSTEM:"$reply"

install -m 755 /tmp/egret-lab-check /usr/local/sbin/egret-lab-check
rm -f /tmp/egret-lab-check
echo "provision-client: the lab is up; run: sudo egret-lab-check"
