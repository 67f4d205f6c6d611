#!/bin/bash
# PID 1 of the guest once its root is the host's (read-only, under a tmpfs
# overlay): mounts what the tests expect, runs /egret-out/cmd in the
# directory /egret-out/cwd names, records its exit status in /egret-out/rc
# and powers the machine off. Its output goes to the serial console, which
# tests/guest-kernel/run.sh prints.
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t bpf bpf /sys/fs/bpf
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
ip link set lo up
# The open-files limits systemd gives a gateway machine (PID 1 here is this
# script, and the kernel's own default hard limit is 4096).
ulimit -Hn 524288
ulimit -Sn 1024
hostname egret-guest
export PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TERM=dumb
# The caller's environment, one NAME=value per line (run.sh writes it).
while IFS= read -r line; do export "${line?}"; done < /egret-out/env
echo "guest: Linux $(uname -r), $(nproc) CPUs, $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) MiB"
cd "$(cat /egret-out/cwd)" && bash /egret-out/cmd < /dev/null
echo $? > /egret-out/rc
sync
echo o > /proc/sysrq-trigger
sleep 30
