# shellcheck shell=bash
# Reads /etc/egret/node.conf (the node's boot settings; node.conf.example
# documents them) into EGRET_* variables. KEY="VALUE" lines only, known keys
# only, each value checked: the file is never executed. Sourced by the boot
# scripts in /usr/lib/egret.
# shellcheck disable=SC2034 # used by the scripts that source this
EGRET_NODE_CONF=${EGRET_NODE_CONF:-/etc/egret/node.conf}
EGRET_POD_INTERFACES="" EGRET_POD_CIDRS="" EGRET_KEEP_CIDRS=""
EGRET_NIC_INTERFACES="" EGRET_IRQ_CPUS="" EGRET_METRICS=127.0.0.1:9469
EGRET_READY_TIMEOUT=300

# Prints to the journal and the console (the serial log tests read).
egret_say() { printf 'EGRET-NODE %s\n' "$*" | tee /dev/console; }

egret_read_node_conf() {
  local line key value n=0 bad=0
  [[ -f $EGRET_NODE_CONF ]] || return 0
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    if [[ ! $line =~ ^([A-Z_]+)=\"([^\"\`\$\\]*)\"[[:space:]]*$ && ! $line =~ ^([A-Z_]+)=([^\"\`\$\\[:space:]]*)[[:space:]]*$ ]]; then
      echo "$EGRET_NODE_CONF:$n: not KEY=\"VALUE\": $line" >&2; bad=1; continue
    fi
    key=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
    case $key in
      EGRET_POD_INTERFACES | EGRET_NIC_INTERFACES) [[ $value =~ ^[[:space:]]*([A-Za-z0-9_.:-]+[[:space:]]*)*$ ]] ;;
      EGRET_POD_CIDRS | EGRET_KEEP_CIDRS) [[ $value =~ ^[[:space:]]*([0-9A-Fa-f.:]+/[0-9]+[[:space:]]*)*$ ]] ;;
      EGRET_IRQ_CPUS) [[ $value =~ ^[0-9,-]*$ ]] ;;
      # `]` first in the bracket is a literal `]` (a backslash there is a
      # literal backslash, so `\]` closed the bracket and refused every value).
      EGRET_METRICS) [[ $value =~ ^[][0-9A-Fa-f.:]+:[0-9]+$ ]] ;;
      EGRET_READY_TIMEOUT) [[ $value =~ ^[0-9]+$ ]] ;;
      *) echo "$EGRET_NODE_CONF:$n: unknown key $key" >&2; bad=1; continue ;;
    esac || { echo "$EGRET_NODE_CONF:$n: $key: bad value \"$value\"" >&2; bad=1; continue; }
    printf -v "$key" '%s' "$value"
  done <"$EGRET_NODE_CONF"
  return "$bad"
}

egret_uptime() { cut -d' ' -f1 /proc/uptime; }
