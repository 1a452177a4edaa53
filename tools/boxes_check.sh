#!/usr/bin/env bash
# The boxes check (docs/boxes-check.md): a plant on Debian 12 boxes booted by systemd. Each
# box is a container (systemd-nspawn --boot) on a private bridge with its own hostname and
# address; edgebus is installed from this checkout as docs/install-a-box.md tells a box, the
# broker box runs Debian's mosquitto.service with the files `edgebus init` and `edgebus
# broker mosquitto-config` wrote, the agents run under the units in systemd/. A gateway on
# the host asks the plant and holds every answer token for token to llama.cpp whole, then
# again while faults hit the boxes: a stage killed, frozen, rebooted, its power cut, the
# broker's box and the coordinator's rebooted.
#
# Run as root on a Debian 12 x86_64 host:  tools/boxes_check.sh
# It installs the host tools it needs (systemd-container debootstrap).
# Environment (all optional):
#   EDGEBUS_BOXES_CACHE  what a second run reuses: the root filesystem's tarball, the
#                        llama-cpp-python wheel, pip's cache (default /var/cache/edgebus-boxes)
#   EDGEBUS_BOXES_FAULTS the faults to run, in order (default: all of FAULTS below; "none"
#                        stops after the plant's first answers)
#   EDGEBUS_BOXES_KEEP=1 leave the boxes running at the end: then
#                        `tools/boxes_check.sh in BOX COMMAND...` runs a command in a box
#                        (systemctl, journalctl), `tools/boxes_check.sh stop` stops them
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${EDGEBUS_BOXES_CACHE:-/var/cache/edgebus-boxes}
SUITE=bookworm
# What every box needs: systemd as init, its network (networkd, ip), Python with venv and
# headers and a compiler (pip compiles edgebus's two small C helpers, and llama-cpp-python
# once for the wheel cache), llama.cpp's OpenMP runtime, and Debian's Mosquitto (enabled on
# the broker's box only).
ROOTFS_PACKAGES=systemd,systemd-sysv,dbus,iproute2,procps,python3,python3-venv,python3-dev,\
gcc,g++,make,cmake,ca-certificates,libgomp1,mosquitto
FAULTS_ALL="kill-stage freeze-stage reboot-stage power-cut-stage reboot-broker reboot-coordinator"
FAULTS=${EDGEBUS_BOXES_FAULTS:-$FAULTS_ALL}
# The boxes' private network: a bridge on the host, outside 10.64.0.0/10 where the
# rehearsal picks its subnets (edgebus/rehearse/netns.py), so both can run at once.
BRIDGE=edgebus-boxes
NET=10.231.77
HOST_ADDRESS=$NET.1
declare -A ADDRESS=([broker]=$NET.10 [coordinator]=$NET.11
                    [stage-0]=$NET.20 [stage-1]=$NET.21 [stage-2]=$NET.22)
BOXES=(broker coordinator stage-0 stage-1 stage-2)
STAGE_BOXES=(stage-0 stage-1 stage-2)
BROKER_URL=mqtts://broker:8883
MODEL=/var/lib/edgebus/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Requests in flight at each fault, and those sent while the box is down.
IN_FLIGHT=3
DURING=2
# Bounds on failing, not waits: a box boots in seconds and a stage loads in seconds here;
# the stage's unit allows it 10 minutes (TimeoutStartSec=).
BOOT_S=120
ACTIVE_S=300

WORK=$CACHE/run
IMAGE=$WORK/image
TIMES=$WORK/times
LOGS=$WORK/logs
CGROUPS=(/sys/fs/cgroup/unified/edgebus-boxes /sys/fs/cgroup/systemd/edgebus-boxes)
PIN=$(sed -n 's/^PINNED = "\(.*\)"$/\1/p' "$REPO/node_agent/engines/llamacpp/library.py")
ROOTFS_TAR=$CACHE/rootfs-$SUITE-amd64.tar
MOUNTS=()

# shellcheck source=tools/debian_check.sh
. "$REPO/tools/debian_check.sh"

# --- the host ---------------------------------------------------------------------------

host_tools() {
    [[ $(id -u) == 0 ]] || die "run as root (debootstrap, mounts, containers, a bridge)"
    [[ $(uname -m) == x86_64 ]] || die "an x86_64 host (the root filesystem is amd64)"
    [[ -n $PIN ]] || die "no PINNED version in node_agent/engines/llamacpp/library.py"
    if ! command -v systemd-nspawn >/dev/null || ! command -v debootstrap >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=900 update -qq
        apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends \
            systemd-container debootstrap >/dev/null
    fi
    grep -qw overlay /proc/filesystems || modprobe overlay \
        || die "the kernel has no overlayfs, which each box's root filesystem is"
}



# --- the image every box starts from ------------------------------------------------------

rootfs() {
    debian_rootfs "$ROOTFS_TAR" "$IMAGE" --variant=minbase --include="$ROOTFS_PACKAGES" "$SUITE"
}

chroot_mounts() {  # DIR: what a chroot needs (proc, dev, sys, the cache), undone at exit
    local dir=$1 what
    mount -t proc proc "$dir/proc"
    MOUNTS+=("$dir/proc")
    for what in dev sys; do
        mount --rbind "/$what" "$dir/$what"
        # Unmounting the copy must never unmount the host's own /dev or /sys.
        mount --make-rslave "$dir/$what"
        MOUNTS+=("$dir/$what")
    done
    mkdir -p "$dir/check/cache"
    mount --bind "$CACHE" "$dir/check/cache"
    MOUNTS+=("$dir/check/cache")
}

in_chroot() {  # DIR COMMAND...: a command in a chroot, with the cache's pip settings
    local dir=$1
    shift
    chroot "$dir" /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
        PATH=/opt/edgebus/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        PIP_CERT=/etc/ssl/certs/host-ca.crt SSL_CERT_FILE=/etc/ssl/certs/host-ca.crt \
        PIP_CACHE_DIR=/check/cache/pip PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"
}

# llama.cpp's AMX kernel died of SIGSEGV on `ldtilecfg` in every stage box of a 2-vCPU Xeon
# VM that advertises AMX: GCC 12's `_tile_loadconfig` names 8 bytes of memory, so the stores
# of the rest of the 64-byte tile configuration were dropped (docs/boxes-check.md). A build
# without AMX, the docs' recipe (docs/install-a-box.md), runs on any x86 CPU.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"

llama_wheel() {  # the wheel of the pinned llama-cpp-python, compiled once for this CPU
    mkdir -p "$CACHE/wheels"
    ls "$CACHE/wheels"/llama_cpp_python-"$PIN"-*.whl >/dev/null 2>&1 && return
    # As docs/install-a-box.md builds it on a box: the library alone, for this CPU
    # (GGML_NATIVE). Every box is a container on this host, so one build fits them all.
    in_chroot "$IMAGE" env CMAKE_ARGS="$LLAMA_CMAKE_ARGS" pip wheel -q --no-deps --no-cache-dir \
        --no-binary llama-cpp-python -w /check/cache/wheels "llama-cpp-python==$PIN" \
        >"$WORK/wheel.log" 2>&1 || die "building llama-cpp-python: see $WORK/wheel.log"
}

install_image() {
    # The project as a clean clone has it: tracked and new files, nothing ignored.
    mkdir -p "$IMAGE/check/src"
    git -C "$REPO" ls-files -z -co --exclude-standard \
        | tar -C "$REPO" --null --ignore-failed-read -T - -cf - | tar -C "$IMAGE/check/src" -xf -
    chroot_mounts "$IMAGE"
    cp /etc/resolv.conf "$IMAGE/etc/resolv.conf"
    # pip inside trusts what the host trusts (a proxy's own CA, say).
    cp /etc/ssl/certs/ca-certificates.crt "$IMAGE/etc/ssl/certs/host-ca.crt"
    in_chroot "$IMAGE" python3 -m venv /opt/edgebus
    step "llama-cpp-python wheel" llama_wheel
    # docs/install-a-box.md, "Installing on each box": a box without torch.
    in_chroot "$IMAGE" sh -c "pip install -q /check/cache/wheels/llama_cpp_python-$PIN-*.whl"
    in_chroot "$IMAGE" pip install -q /check/src
    if in_chroot "$IMAGE" python -c 'import torch' 2>/dev/null; then die "torch came in"; fi
    in_chroot "$IMAGE" useradd --system --user-group --home-dir /var/lib/edgebus \
        --shell /usr/sbin/nologin edgebus
    install -d -m 0755 "$IMAGE/etc/edgebus"
    cp "$REPO"/systemd/*.service "$IMAGE/etc/systemd/system/"
    # Debian enables Mosquitto where it is installed: only the broker's box runs it.
    in_chroot "$IMAGE" systemctl disable -q mosquitto
    # Each box's address comes from systemd-networkd, on the link nspawn gives it.
    in_chroot "$IMAGE" systemctl enable -q systemd-networkd
    # Nobody logs in on a box's console; its getty would only fill the console log.
    in_chroot "$IMAGE" systemctl mask -q console-getty.service
    # The journal survives a box's reboot, so what an operator reads after one is there.
    install -d "$IMAGE/var/log/journal"
    {
        echo "127.0.0.1 localhost"
        local box
        for box in "${BOXES[@]}"; do echo "${ADDRESS[$box]} $box"; done
    } >"$IMAGE/etc/hosts"
    rm -rf "$IMAGE/check/src"
    unmount_all
}

# --- boxes --------------------------------------------------------------------------------

box_dir() { echo "$WORK/boxes/$1"; }

overlay() {  # NAME: a root filesystem of its own over the image, kept across its reboots
    local dir
    dir=$(box_dir "$1")
    mkdir -p "$dir/upper" "$dir/work" "$dir/root"
    mount -t overlay overlay -o "lowerdir=$IMAGE,upperdir=$dir/upper,workdir=$dir/work" \
        "$dir/root"
}

network_config() {  # NAME: its hostname and address, as a box's own files
    local root
    root=$(box_dir "$1")/root
    echo "$1" >"$root/etc/hostname"
    mkdir -p "$root/etc/systemd/network"
    printf '[Match]\nName=host0\n\n[Network]\nAddress=%s/24\n' "${ADDRESS[$1]}" \
        >"$root/etc/systemd/network/80-box.network"
}

boot() {  # NAME: start the box; a `reboot` inside it boots it again, as a machine would
    local name=$1 dir cg
    dir=$(box_dir "$name")
    for cg in "${CGROUPS[@]}"; do mkdir -p "$cg/$name"; done
    (
        # A control group per box: nspawn, which cannot ask systemd for a scope on this
        # host, makes its payload group under the group it runs in.
        for cg in "${CGROUPS[@]}"; do echo "$BASHPID" >"$cg/$name/cgroup.procs"; done
        while :; do
            rc=0
            systemd-nspawn --boot --quiet --register=no --keep-unit --machine="$name" \
                --directory="$dir/root" --network-bridge="$BRIDGE" --console=read-only || rc=$?
            echo "== systemd-nspawn exited with $rc at $(date -u +%T)"
            # 133: the box rebooted itself.
            [[ $rc == 133 ]] || break
        done
    ) </dev/null >>"$dir/console.log" 2>&1 &
    echo $! >"$dir/supervisor.pid"
    # Its end (a power cut kills it) is no job of this shell's to report.
    disown $!
}

box_pids() {  # NAME: every process inside the box
    cat "${CGROUPS[0]}/$1"/payload/cgroup.procs \
        $(find "${CGROUPS[0]}/$1/payload" -mindepth 2 -name cgroup.procs 2>/dev/null) \
        2>/dev/null || true
}

leader() {  # NAME: the host's pid of the box's init (pid 1 inside it)
    local pid
    for pid in $(box_pids "$1"); do
        awk '/^NSpid:/ {exit !($NF == 1)}' "/proc/$pid/status" 2>/dev/null \
            && { echo "$pid"; return 0; }
    done
    return 1
}

in_box() {  # NAME COMMAND...: a command inside a box, as root in all its namespaces
    local pid
    pid=$(leader "$1") || { log "box $1 is not running"; return 1; }
    shift
    nsenter --target "$pid" --all /usr/bin/env -i LANG=C.UTF-8 SYSTEMD_COLORS=0 \
        PATH=/opt/edgebus/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
}

wait_booted() {  # NAME [OLD-LEADER]: until its systemd (not OLD-LEADER's) has finished booting
    local name=$1 old=${2:-} t0=$SECONDS state= pid
    while ((SECONDS - t0 < BOOT_S)); do
        pid=$(leader "$name") && [[ $pid != "$old" ]] \
            && state=$(in_box "$name" systemctl is-system-running 2>/dev/null || true)
        case $state in
            running) return 0 ;;
            degraded) in_box "$name" systemctl --failed --no-pager >&2
                      die "box $name booted degraded" ;;
        esac
        sleep 1
    done
    die "box $name did not finish booting within $BOOT_S s (state: ${state:-none}); see $(box_dir "$name")/console.log"
}

wait_active() {  # NAME UNIT: until the unit is active (Type=notify: READY=1 came)
    local name=$1 unit=$2 t0=$SECONDS state
    while ((SECONDS - t0 < ACTIVE_S)); do
        state=$(in_box "$name" systemctl is-active "$unit" 2>/dev/null || true)
        [[ $state == active ]] && return 0
        sleep 1
    done
    in_box "$name" systemctl status --no-pager "$unit" >&2 || true
    die "$unit on $name is not active after $ACTIVE_S s (state: $state)"
}

power_off() {  # NAME: a clean shutdown, then wait for the container to be gone
    local name=$1 pid
    pid=$(cat "$(box_dir "$name")/supervisor.pid" 2>/dev/null) || return 0
    in_box "$name" systemctl poweroff 2>/dev/null || true
    timeout 60 tail --pid="$pid" -f /dev/null || power_cut "$name"
}

power_cut() {  # NAME: every process of the box killed at once, as when its power goes
    local name=$1 pid
    pid=$(cat "$(box_dir "$name")/supervisor.pid" 2>/dev/null) || return 0
    # The supervisor first, so that it does not boot the box again.
    kill -KILL "$pid" 2>/dev/null || true
    # shellcheck disable=SC2046
    kill -KILL $(box_pids "$name") 2>/dev/null || true
    pkill -KILL -P "$pid" 2>/dev/null || true
    local t0=$SECONDS
    while [[ -n $(box_pids "$name") ]] && ((SECONDS - t0 < 30)); do sleep 0.2; done
    # nspawn itself (outside the payload) goes once its container is gone.
    while pgrep -f -- "--machine=$name " >/dev/null && ((SECONDS - t0 < 30)); do sleep 0.2; done
}

network() {
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$HOST_ADDRESS/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
}

# --- the plant ------------------------------------------------------------------------------

# The gateway: a root filesystem over the image too, in the host's own network (outside the
# boxes), where `edgebus init` ran and the CA's key stays, as on an engineer's machine.
GATEWAY=$WORK/gateway

gw() {  # COMMAND...: in the gateway's chroot
    in_chroot "$GATEWAY/root" "$@"
}

gateway() {
    local dir=$GATEWAY
    mkdir -p "$dir/upper" "$dir/work" "$dir/root"
    mount -t overlay overlay -o "lowerdir=$IMAGE,upperdir=$dir/upper,workdir=$dir/work" \
        "$dir/root"
    MOUNTS+=("$dir/root")
    chroot_mounts "$dir/root"
    mkdir -p "$dir/root/check/src/tools" "$dir/root/check/out"
    cp "$REPO/tools/whole_answer.py" "$REPO/tools/boxes_gateway.py" "$dir/root/check/src/tools/"
    # docs/install-a-box.md: the model in the services' state directory.
    gw sh -c "install -d /var/lib/edgebus/models && install -m 0644 \"\$(edgebus model bundled)\" /var/lib/edgebus/models/"
    gw edgebus init /etc/edgebus/plant.yaml --model "$MODEL" --stages 3 --broker "$BROKER_URL"
    gw edgebus broker mosquitto-config /etc/edgebus/plant.yaml /check/out/mosquitto \
        --install-dir /etc/mosquitto/edgebus
}

give() {  # BOX FILE...: the files of /etc/edgebus/credentials a box gets, as install-a-box.md says
    local box=$1 root file
    root=$(box_dir "$box")/root
    shift
    install -m 0644 "$GATEWAY/root/etc/edgebus/plant.yaml" "$root/etc/edgebus/plant.yaml"
    install -d -m 0700 "$root/etc/edgebus/credentials"
    in_chroot "$root" chown edgebus:edgebus /etc/edgebus/credentials
    # The CA certificate is no secret: a folder the edgebus user may enter.
    install -d -m 0755 "$root/etc/edgebus/credentials/tls"
    install -m 0644 "$GATEWAY/root/etc/edgebus/credentials/tls/ca.crt" \
        "$root/etc/edgebus/credentials/tls/"
    for file in "$@"; do
        install -m 0600 "$GATEWAY/root/etc/edgebus/credentials/$file" \
            "$root/etc/edgebus/credentials/$file"
        in_chroot "$root" chown edgebus:edgebus "/etc/edgebus/credentials/$file"
    done
}

install_plant() {  # each box's own files, into its root filesystem before its first boot
    local box root
    for box in "${BOXES[@]}"; do
        overlay "$box"
        network_config "$box"
    done
    # The broker's box: Mosquitto's config, password file and ACL (systemd/README.md), and
    # the TLS files its listener names, which the mosquitto user must be able to read.
    root=$(box_dir broker)/root
    install -d -m 0750 "$root/etc/mosquitto/edgebus"
    install -m 0640 "$GATEWAY"/root/check/out/mosquitto/{passwd,acl} "$root/etc/mosquitto/edgebus/"
    install -m 0640 "$GATEWAY/root/check/out/mosquitto/mosquitto.conf" \
        "$root/etc/mosquitto/conf.d/edgebus.conf"
    install -d -m 0755 "$root/etc/edgebus/credentials/tls"
    install -m 0644 "$GATEWAY"/root/etc/edgebus/credentials/tls/{ca.crt,broker.crt} \
        "$root/etc/edgebus/credentials/tls/"
    install -m 0640 "$GATEWAY/root/etc/edgebus/credentials/tls/broker.key" \
        "$root/etc/edgebus/credentials/tls/"
    in_chroot "$root" chgrp -R mosquitto /etc/mosquitto/edgebus /etc/mosquitto/conf.d/edgebus.conf \
        /etc/edgebus/credentials/tls/broker.key
    in_chroot "$root" systemctl enable -q mosquitto
    # The agents' boxes: plant file, own password, the model.
    give coordinator coordinator.password
    local stage
    for stage in "${STAGE_BOXES[@]}"; do give "$stage" "$stage.password"; done
    for box in coordinator "${STAGE_BOXES[@]}"; do
        root=$(box_dir "$box")/root
        install -d "$root/var/lib/edgebus/models"
        cp "$GATEWAY/root$MODEL" "$root$MODEL"
        in_chroot "$root" chown -R edgebus:edgebus /var/lib/edgebus
    done
}

boot_all() {
    local box
    for box in "${BOXES[@]}"; do boot "$box"; done
    for box in "${BOXES[@]}"; do wait_booted "$box"; done
}

enable_units() {  # `systemctl enable --now`, as docs/systemd.md tells each box
    local stage
    in_box coordinator systemctl enable --now edgebus-coordinator
    for stage in "${STAGE_BOXES[@]}"; do in_box "$stage" systemctl enable --now "edgebus-node@$stage"; done
    wait_active coordinator edgebus-coordinator
    for stage in "${STAGE_BOXES[@]}"; do wait_active "$stage" "edgebus-node@$stage"; done
}

references() {
    gw python /check/src/tools/boxes_gateway.py references /etc/edgebus/plant.yaml \
        /check/out/references.json
}

check_wave() {  # WAVE...: each request token-exact or refused, none lost
    gw python /check/src/tools/boxes_gateway.py check /check/out/references.json /check/out "$@" \
        | tee -a "$LOGS/answers.txt"
}

first_answers() {
    gw python /check/src/tools/boxes_gateway.py send /etc/edgebus/plant.yaml first 5 /check/out
    check_wave first
}

# --- faults -----------------------------------------------------------------------------------

send_wave() {  # WAVE COUNT [nowait]: asked in the background; returns once all are being
    local wave=$1 count=$2 t0=$SECONDS  # generated, or at once with `nowait`
    rm -f "$GATEWAY/root/check/out/$wave".{json,inflight}
    gw python /check/src/tools/boxes_gateway.py send /etc/edgebus/plant.yaml "$wave" "$count" \
        /check/out &
    WAVES+=($!)
    [[ ${3:-} == nowait ]] && return
    while [[ ! -e $GATEWAY/root/check/out/$wave.inflight ]]; do
        ((SECONDS - t0 < 120)) || die "wave $wave was not streaming within 120 s"
        sleep 0.1
    done
}

record() {  # FAULT BOX UNIT SINCE: what an operator sees, saved, and its key lines shown
    local fault=$1 box=$2 unit=$3 since=$4 out
    out=$LOGS/$fault-$box
    in_box "$box" systemctl status --no-pager -n 0 "$unit" >"$out.status" 2>&1 || true
    in_box "$box" journalctl --no-pager -o short-precise --since "$since" -u 'edgebus-*' \
        -u mosquitto >"$out.journal" 2>&1 || true
    log "$box: systemctl status $unit"
    grep -E '^ *(Active|Main PID|Status):' "$out.status" >&2 || true
    log "$box: journalctl -u 'edgebus-*' since the fault: systemd's lines and the agent's warnings"
    grep -E 'systemd\[1\]|WARNING|ERROR|CRITICAL|^-- Boot' "$out.journal" >&2 || true
    if [[ $box == broker ]]; then
        # Debian's mosquitto.conf logs to a file, not the journal; its persistence: below.
        log "broker: /var/log/mosquitto/mosquitto.log around the reboot, and its database"
        in_box broker sh -c 'grep -E "terminating|Saving|starting|running" \
            /var/log/mosquitto/mosquitto.log | tail -6; ls -l /var/lib/mosquitto/' >&2 || true
    fi
    if [[ $box != coordinator ]]; then
        in_box coordinator journalctl --no-pager -o short-precise --since "$since" \
            -u edgebus-coordinator >"$LOGS/$fault-coordinator.journal" 2>&1 || true
    fi
    log "coordinator: journalctl -u edgebus-coordinator since the fault: joins, leaves, replays, errors"
    grep -E 'leave:|join:|warning:|error:|WARNING|ERROR|stopping with|resuming|systemd\[1\]' \
        "$LOGS/$fault-coordinator.journal" | cut -c1-220 >&2 || true
}

restarts() {  # BOX UNIT: how often systemd has restarted the unit since the box booted
    in_box "$1" systemctl show -P NRestarts "$2" 2>/dev/null || echo 0
}

wait_restarted() {  # BOX UNIT BEFORE: until systemd has restarted the unit (NRestarts grew)
    local t0=$SECONDS
    while (($(restarts "$1" "$2") <= $3)); do
        ((SECONDS - t0 < ACTIVE_S)) || die "$2 on $1 was not restarted within $ACTIVE_S s"
        sleep 1
    done
}

fault() {  # FAULT: one fault with requests in flight; then every request accounted for
    local fault=$1 since box unit old before pid
    case $fault in
        kill-stage|freeze-stage|reboot-stage) box=stage-1 unit=edgebus-node@stage-1 ;;
        power-cut-stage) box=stage-2 unit=edgebus-node@stage-2 ;;
        reboot-broker) box=broker unit=mosquitto ;;
        reboot-coordinator) box=coordinator unit=edgebus-coordinator ;;
        *) die "no fault $fault (faults: $FAULTS_ALL)" ;;
    esac
    since=$(date -u '+%Y-%m-%d %H:%M:%S')
    old=$(leader "$box")
    before=$(restarts "$box" "$unit")
    WAVES=()
    send_wave "$fault" "$IN_FLIGHT"
    log "$fault: $IN_FLIGHT requests in flight"
    case $fault in
        kill-stage) in_box "$box" systemctl kill -s KILL "$unit" ;;
        freeze-stage) in_box "$box" systemctl kill -s STOP "$unit" ;;
        power-cut-stage) power_cut "$box"; sleep 2; boot "$box" ;;
        *) in_box "$box" systemctl --no-block reboot ;;
    esac
    # Requests sent while the box is away.
    sleep 2
    send_wave "$fault-during" "$DURING" nowait
    for pid in "${WAVES[@]}"; do wait "$pid" || true; done
    # The box is back in service on its own: booted again, the unit restarted and active.
    case $fault in
        kill-stage|freeze-stage) wait_restarted "$box" "$unit" "$before" ;;
        *) wait_booted "$box" "$old" ;;
    esac
    wait_active "$box" "$unit"
    record "$fault" "$box" "$unit" "$since"
    check_wave "$fault" "$fault-during"
}

faults() {
    local f
    [[ $FAULTS == none ]] && return
    for f in $FAULTS; do step "fault: $f" fault "$f"; done
}

# --- the whole check ------------------------------------------------------------------------

stop_all() {
    local box
    for box in "${BOXES[@]}"; do power_off "$box" & done
    wait
    for box in "${BOXES[@]}"; do
        mountpoint -q "$(box_dir "$box")/root" && umount "$(box_dir "$box")/root"
    done
    local cg
    for cg in "${CGROUPS[@]}"; do
        [[ -d $cg ]] && find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null
    done
    mountpoint -q "$GATEWAY/root" && umount -R "$GATEWAY/root"
    ip link del "$BRIDGE" 2>/dev/null || true
}

cleanup() {
    local rc=$?
    unmount_all
    [[ ${EDGEBUS_BOXES_KEEP:-} == 1 ]] || stop_all
    [[ -f $TIMES ]] && { log "times:"; cat "$TIMES" >&2; }
    return $rc
}

case ${1:-} in
    stop) stop_all; exit 0 ;;
    in) [[ $# -ge 3 ]] || die "usage: tools/boxes_check.sh in BOX COMMAND..."
        shift; in_box "$@"; exit ;;
    "") ;;
    *) die "usage: tools/boxes_check.sh [stop | in BOX COMMAND...]" ;;
esac
mkdir -p "$WORK"
: >"$TIMES"
log "llama-cpp-python $PIN; cache $CACHE; load: $(cut -d' ' -f1-3 /proc/loadavg)"
step "host tools" host_tools
stop_all  # what an interrupted run left
rm -rf "$WORK/boxes" "$GATEWAY" "$LOGS"
mkdir -p "$LOGS"
trap cleanup EXIT
step "root filesystem" rootfs
step "install (image)" install_image
step "init (gateway)" gateway
step "boxes' files" install_plant
network
step "boot 5 boxes" boot_all
step "units enabled, agents ready" enable_units
step "whole-model references" references
step "first answers" first_answers
faults
log "PASSED; logs in $LOGS; load: $(cut -d' ' -f1-3 /proc/loadavg)"
