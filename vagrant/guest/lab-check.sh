#!/usr/bin/env bash
# egret-lab-check: what the external server sees from each pod of the
# Vagrant lab (installed in the client VM by provision-client.sh; run as
# root there: `vagrant ssh client -c 'sudo egret-lab-check'`).
#
# Each pod opens a TCP connection to the server, which answers with the
# source address and port it saw. The pods a policy selects must arrive
# with their egress IP (translated by egret in the gateway VM); pod U (no
# policy) and an excluded destination keep the pod's own address (the
# gateway's kernel forwards them). Exits non-zero if any differs.
set -uo pipefail
P=egret-vg

# pod  source  destination  expected source at the server  why
checks=(
  "a  198.18.0.10      198.51.100.7    203.0.113.10      policy a: E1"
  "b  198.18.0.11      198.51.100.7    203.0.113.10      policy a: E1"
  "c  198.18.1.10      198.51.100.7    203.0.113.11      policy c: E2"
  "u  198.18.2.10      198.51.100.7    198.18.2.10       no policy: untouched"
  "a  198.18.0.10      198.51.100.200  198.18.0.10       excluded destination: untouched"
  "v6 2001:db8:18::10  2001:db8:51::7  2001:db8:113::10  policy a: E6"
)

# An IPv6 address in its short form (socat prints all eight groups in full).
compress6() {
  local IFS=: g s run
  local -a groups short=()
  read -ra groups <<<"$1"
  for g in "${groups[@]}"; do short+=("$(printf '%x' "$((16#${g:-0}))")"); done
  s=":${short[*]}:"
  # The longest run of zero groups (two or more) becomes "::".
  for run in :0:0:0:0:0:0:0:0: :0:0:0:0:0:0:0: :0:0:0:0:0:0: :0:0:0:0:0: :0:0:0:0: :0:0:0: :0:0:; do
    if [[ $s == *"$run"* ]]; then
      s=${s/"$run"/::}
      break
    fi
  done
  [[ $s == ::* ]] || s=${s#:}
  [[ $s == *:: ]] || s=${s%:}
  printf '%s\n' "$s"
}

fail=0
printf '%-7s %-17s %-16s %-28s %s\n' pod source destination "server saw" result
for c in "${checks[@]}"; do
  read -r pod src dst want why <<<"$c"
  if [[ $dst == *:* ]]; then target="TCP6:[$dst]:80"; else target="TCP4:$dst:80"; fi
  out=$(ip netns exec "$P-pod-$pod" timeout 10 socat -T 5 - "$target" </dev/null 2>&1)
  # "saw ADDR PORT"; socat may bracket an IPv6 address.
  read -r word addr port <<<"$out"
  addr=${addr#[}
  addr=${addr%]}
  [[ $addr == *:*:*:*:*:*:*:* && $addr != *::* ]] && addr=$(compress6 "$addr")
  if [[ $word == saw && $addr == "$want" ]]; then
    result="ok ($why)"
  else
    result="FAIL: want $want ($why)"
    fail=1
  fi
  [[ $word == saw ]] && seen="$addr:$port" || seen="(${out:-no answer})"
  printf '%-7s %-17s %-16s %-28s %s\n' "pod-$pod" "$src" "$dst" "$seen" "$result"
done
if ((fail)); then
  echo "egret-lab-check: FAILED" >&2
  exit 1
fi
echo "egret-lab-check: every pod left as its policy says"
