# What tools/boxes_check.sh and tools/aarch64_check.sh share, sourced by both: logging,
# timed steps, and a Debian root filesystem made once by debootstrap and kept as a tarball.
# The sourcing script sets WORK (its scratch folder), TIMES (where step times go) and MOUNTS
# (an array of what it mounted, undone by unmount_all).

log() { printf '== %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

step() {  # step NAME FUNCTION [ARGS]: run it and record how long it took
    local name=$1 t0=$SECONDS
    shift
    log "$name ..."
    "$@"
    printf '%-34s %5d s\n' "$name" $((SECONDS - t0)) | tee -a "$TIMES" >&2
}

mirror() {  # the Debian mirror this host's apt already uses
    local uri
    uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
          | awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}')
    [[ -n $uri ]] || uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
          | awk '$1 == "URIs:" && $2 !~ /security/ {print $2; exit}')
    echo "${uri:-http://deb.debian.org/debian}"
}

unmount_all() {  # what MOUNTS holds, last first
    local i
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        umount -R "${MOUNTS[i]}" 2>/dev/null || umount -R -l "${MOUNTS[i]}" || true
    done
    MOUNTS=()
}

mounted_below() { findmnt -rn -o TARGET | grep -q "^$1\(/\|$\)"; }

debian_rootfs() {  # TARBALL DIR DEBOOTSTRAP-ARGS...: DIR afresh from TARBALL, made first if absent
    local tarball=$1 dir=$2 boot=$WORK/debootstrap
    shift 2
    if [[ ! -f $tarball ]]; then
        mounted_below "$boot" && die "$boot still has mounts"
        rm -rf "$boot"
        debootstrap "$@" "$boot" "$(mirror)" >"$WORK/debootstrap.log" 2>&1 \
            || die "debootstrap: see $WORK/debootstrap.log"
        tar -C "$boot" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
        rm -rf "$boot"
    fi
    # Every run starts from the tarball: nothing a previous run installed is reused but
    # what the cache holds on purpose.
    mounted_below "$dir" && die "$dir still has mounts"
    rm -rf "$dir"
    mkdir -p "$dir"
    tar -C "$dir" -xf "$tarball"
}
