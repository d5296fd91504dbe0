#!/usr/bin/env bash
# Cold boot versus snapshot restore of Locker's microVM guest, measured with nothing but
# QEMU and bash: for hosts where the Locker server cannot be installed (a borrowed machine
# with KVM but no package manager). On a normal host use `bench/run --only microvm`, which
# measures the same through the real server.
#
#   bench/microvm-kvm.sh BUNDLE_DIR [OUT_DIR]
#
# BUNDLE_DIR holds bin/qemu-system-x86_64 (with lib/ holding its shared libraries and the
# dynamic loader, share/ its firmware, modules/ its TCG accelerator module), and vm/{vmlinuz,initrd.cpio,template.ext4,disk.img}:
# Locker's guest kernel, its initramfs (the agent as init), a template image and a blank
# writable disk. The guest is "ready" when its agent answers on the virtio-serial port (it
# sends its protocol Hello as soon as a host connects). A restore maps the saved RAM file
# copy-on-write and loads only the device state (migration capability x-ignore-shared),
# exactly as the microVM runtime does.
set -uo pipefail
B=$(cd "${1:?bundle dir}" && pwd)
OUT=${2:-$PWD}
mkdir -p "$OUT"
W=$(mktemp -d /dev/shm/locker-kvm.XXXX)
trap 'pkill -9 -f "$W" 2>/dev/null; rm -rf "$W"' EXIT
say() { echo "$*" | tee -a "$OUT/microvm-kvm.txt"; }
now() { date +%s%N; }

say "host: $(uname -r) | $(nproc) cpus | $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
say "kvm: $(ls -la /dev/kvm 2>&1) | modules: $(ls -d /sys/module/kvm* 2>/dev/null | xargs -n1 basename 2>/dev/null | xargs)"
LD=$(ls "$B"/lib/ld-linux-x86-64.so.2)
Q=("$LD" --library-path "$B/lib" "$B/bin/qemu-system-x86_64" -L "$B/share")
# QEMU's TCG accelerator is a loadable module in Debian's build.
[[ -d $B/modules ]] && export QEMU_MODULE_DIR=$B/modules
"${Q[@]}" --version | head -1 | while read -r l; do say "qemu: $l"; done
KHZ=$(awk -F: '/cpu MHz/{printf "%d", $2*1000; exit}' /proc/cpuinfo)
KHZ=${KHZ:-2000000}

port=20000
# start ACCEL RAM SHARE INCOMING -> sets PID, AP (agent port), QP (QMP port)
start() {
  local accel=$1 ram=$2 share=$3 incoming=$4 cpu=max
  [[ $accel == kvm ]] && cpu=host
  port=$((port + 2)); AP=$port; QP=$((port + 1))
  if [[ $incoming == yes ]]; then
    cp --sparse=always "$W/base-disk.img" "$W/disk-$AP.img"
  else
    cp --sparse=always "$B/vm/disk.img" "$W/disk-$AP.img"
  fi
  local extra=()
  [[ $incoming == yes ]] && extra=(-incoming defer)
  "${Q[@]}" -M microvm,rtc=on,memory-backend=mem -accel "$accel" -cpu "$cpu" -m 256M -smp 1 \
    -object "memory-backend-file,id=mem,size=256M,mem-path=$ram,share=$share" \
    -nodefaults -no-user-config -display none -no-reboot -serial "file:$W/console-$AP.log" \
    -kernel "$B/vm/vmlinuz" -initrd "$B/vm/initrd.cpio" \
    -append "console=ttyS0 quiet panic=-1 reboot=t rdinit=/init tsc_early_khz=$KHZ tsc=reliable LOCKER_VM=1" \
    -drive "id=template,file=$B/vm/template.ext4,format=raw,if=none,readonly=on" -device virtio-blk-device,drive=template \
    -drive "id=disk,file=$W/disk-$AP.img,format=raw,if=none" -device virtio-blk-device,drive=disk \
    -device virtio-serial-device -chardev "socket,id=agent,host=127.0.0.1,port=$AP,server=on,wait=off" \
    -device virtserialport,chardev=agent,name=org.locker.agent \
    -qmp "tcp:127.0.0.1:$QP,server=on,wait=off" "${extra[@]}" >"$W/qemu-$AP.log" 2>&1 &
  PID=$!
}

# qmp PORT CMD... : runs QMP commands, prints each answer line
qmp() {
  local p=$1 q line; shift
  for _ in $(seq 200); do { exec {q}<>"/dev/tcp/127.0.0.1/$p"; } 2>/dev/null && break; sleep 0.005; done
  read -r -t 10 -u "$q" line
  printf '{"execute":"qmp_capabilities"}\n' >&"$q"; read -r -t 10 -u "$q" line
  for c in "$@"; do
    printf '%s\n' "$c" >&"$q"
    while read -r -t 60 -u "$q" line; do
      [[ $line == *'"return"'* || $line == *'"error"'* ]] && { echo "$line"; break; }
    done
  done
  exec {q}>&-
}

# wait_agent PORT: waits for the agent's first byte (its Hello); keeps nothing open
wait_agent() {
  local p=$1 a
  for _ in $(seq 20000); do
    if { exec {a}<>"/dev/tcp/127.0.0.1/$p"; } 2>/dev/null; then
      if timeout 60 dd bs=1 count=1 <&"$a" 2>/dev/null | wc -c | grep -q 1; then exec {a}>&-; return 0; fi
      exec {a}>&-
    fi
    sleep 0.002
  done
  return 1
}

ms() { echo $((($2 - $1) / 1000000)); }

pct() { sort -n | awk '{a[NR]=$1} END {if (NR==0) {print "n=0"; exit} printf "p50 %s ms  p99 %s ms  n=%d", a[int((NR+1)/2)], a[NR], NR}'; }

measure() {
  local accel=$1 boots=$2 restores=$3
  : >"$W/cold.$accel"; : >"$W/restore.$accel"
  for i in $(seq "$boots"); do
    rm -f "$W/ram"; truncate -s 256M "$W/ram"
    t0=$(now); start "$accel" "$W/ram" on no
    if ! wait_agent "$AP"; then say "$accel: the guest did not become ready: $(tail -c 300 "$W/console-$AP.log") $(tail -c 300 "$W/qemu-$AP.log")"; kill -9 "$PID"; return 1; fi
    t1=$(now); ms "$t0" "$t1" >>"$W/cold.$accel"
    if [[ $i -lt $boots ]]; then kill -9 "$PID"; wait "$PID" 2>/dev/null; continue; fi
    # Save the last one as the base: device state only, RAM stays in the shared file.
    sleep 0.2
    t0=$(now)
    qmp "$QP" '{"execute":"stop"}' \
      '{"execute":"migrate-set-capabilities","arguments":{"capabilities":[{"capability":"x-ignore-shared","state":true}]}}' \
      "{\"execute\":\"migrate\",\"arguments\":{\"uri\":\"exec:cat > $W/state\"}}" >/dev/null
    for _ in $(seq 2000); do qmp "$QP" '{"execute":"query-migrate"}' | grep -q completed && break; sleep 0.005; done
    t1=$(now)
    say "$accel: base saved in $(ms "$t0" "$t1") ms; state file $(stat -c %s "$W/state") bytes"
    cp --sparse=always "$W/disk-$AP.img" "$W/base-disk.img"
    qmp "$QP" '{"execute":"quit"}' >/dev/null 2>&1; wait "$PID" 2>/dev/null
  done
  for i in $(seq "$restores"); do
    t0=$(now); start "$accel" "$W/ram" off yes
    qmp "$QP" '{"execute":"migrate-set-capabilities","arguments":{"capabilities":[{"capability":"x-ignore-shared","state":true}]}}' \
      "{\"execute\":\"migrate-incoming\",\"arguments\":{\"uri\":\"exec:cat $W/state\"}}" >/dev/null
    for _ in $(seq 4000); do
      st=$(qmp "$QP" '{"execute":"query-status"}')
      [[ -n ${DEBUG:-} ]] && echo "status: $st" >&2
      [[ $st == *'"status": "running"'* ]] && break
      [[ $st == *'"status": "paused"'* || $st == *'"status": "postmigrate"'* ]] && { qmp "$QP" '{"execute":"cont"}' >/dev/null; break; }
      sleep 0.001
    done
    if ! wait_agent "$AP"; then say "$accel: restore $i did not answer: $(tail -c 300 "$W/qemu-$AP.log")"; kill -9 "$PID"; return 1; fi
    t1=$(now); ms "$t0" "$t1" >>"$W/restore.$accel"
    if [[ $i -eq $restores ]]; then
      sleep 1
      say "$accel: one idle restored VM: QEMU $(grep -E '^(Rss|Pss):' /proc/$PID/smaps_rollup | xargs)"
    fi
    kill -9 "$PID"; wait "$PID" 2>/dev/null
  done
  say "$accel cold boot to agent ready: $(pct <"$W/cold.$accel")"
  say "$accel restore to agent ready:   $(pct <"$W/restore.$accel")"
}

if [[ -d /sys/module/kvm_pvm ]]; then
  say "kvm: PVM-based (kvm_pvm): standard guest kernels hang under it; skipped"
elif [[ -r /dev/kvm && -w /dev/kvm ]]; then
  measure kvm 5 20 || say "kvm: measurement failed"
else
  say "kvm: /dev/kvm is not usable here"
fi
measure tcg "${TCG_BOOTS:-2}" "${TCG_RESTORES:-5}" || say "tcg: measurement failed"
