# The guest's PID 1 (busybox sh). sandbox.vm.image prepends the start: busybox applets,
# /proc /sys /dev mounted, the kernel modules loaded. Diagnostics go to the serial console.
#
# Kernel command line (set by sandbox.session.runtime):
#   sandbox.probe=1          print SANDBOX-PROBE-OK and power off (the KVM probe)
#   (the shares come from the fw_cfg file opt/sandbox/mounts: 9P over TCP to 10.0.2.100:PORT,
#    QEMU guestfwd -> the host's 9P server, one port per share; or virtio-fs, issue 17)
#   (live mounts: the shim mounts more shares later, on spare forwarded ports; see
#    sandbox/guest/control.py)
#   sandbox.msize=BYTES      9P msize for them
#   sandbox.vfs_ra_kb=KIB    readahead of each virtio-fs share (control.VIRTIOFS_READ_AHEAD_KB;
#                            unset: the kernel's 128 KiB)
#   sandbox.net=MODE         disabled | open | allowlist
#   sandbox.upper=tmpfs|disk the writable layer over the read-only guest root: tmpfs
#                            (ephemeral) or the ext4 disk /dev/vda (persistent)
#   sandbox.rootfs=host-usr  the guest root: the host's /usr (QEMU 9p, tag hostusr) and a
#                            root skeleton synthesized by the host (tag rootskel; see
#                            sandbox/vm/guestroot.py), both read-only
#   sandbox.rootfs=image     the same with a cached Debian root's /usr (tag imageusr) and a
#                            skeleton with its /etc (sandbox/vm/imageroot.py)
#   sandbox.uid=U sandbox.gid=G  the guest user `agent` commands run as (default 1000:1000)
#   sandbox.root=1           commands run as root instead (--as-root)
#
# Invariants: no host file but /usr and the skeleton reaches the guest; both exports are
# mounted read-only and never written (the skeleton's export is unmounted once copied); the control port is reachable by root only; the shim is restarted if it dies;
# SANDBOX-READY is printed once everything is mounted and the shim has been started.

say() { echo "sandbox-init: $*"; }
fail() { echo "SANDBOX-FAILED: $*"; sleep 2; poweroff -f; }

MSIZE=524288 NET=disabled UPPER=tmpfs ROOTFS=host-usr VFS_RA_KB=
AGENT_UID=1000 AGENT_GID=1000 AS_ROOT=0
for x in $(cat /proc/cmdline); do
  case "$x" in
    sandbox.probe=1) echo SANDBOX-PROBE-OK; poweroff -f ;;
    sandbox.msize=*) MSIZE=${x#*=} ;;
    sandbox.vfs_ra_kb=*) VFS_RA_KB=${x#*=} ;;
    sandbox.net=*) NET=${x#*=} ;;
    sandbox.upper=*) UPPER=${x#*=} ;;
    sandbox.rootfs=*) ROOTFS=${x#*=} ;;
    # -- the guest user (issue 13)
    sandbox.uid=*) AGENT_UID=${x#*=} ;;
    sandbox.gid=*) AGENT_GID=${x#*=} ;;
    sandbox.root=1) AS_ROOT=1 ;;
  esac
done

# -- guest userland (issue 13): a root without host data. The skeleton (merged-usr links,
# empty directories, the allowlisted /etc) is copied into a tmpfs that root owns — the export
# shows the host's owners — and the host's /usr is mounted beside it. Each gets a writable
# overlay: /upper/root over the skeleton, /upper/usr over /usr (tmpfs, or the persistent disk).
case "$ROOTFS" in
  host-usr) USRTAG=hostusr ;;
  image) USRTAG=imageusr ;;
  *) fail "unknown guest root kind $ROOTFS" ;;
esac
mkdir -p /hostusr /skel /lower /upper /merged
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose $USRTAG /hostusr || fail "cannot mount the guest root's /usr ($USRTAG)"
mount -t 9p -o trans=virtio,version=9p2000.L,ro rootskel /skel || fail "cannot mount the root skeleton"
mount -t tmpfs -o mode=0755 tmpfs /lower
cp -a /skel/. /lower/ || fail "cannot copy the root skeleton"
umount /skel
chown -R -h 0:0 /lower
if [ "$UPPER" = disk ]; then
  mount -t ext4 /dev/vda /upper || fail "cannot mount the persistent disk /dev/vda"
else
  mount -t tmpfs -o mode=0755 tmpfs /upper
fi
mkdir -p /upper/root /upper/work /upper/usr /upper/usrwork
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/root,workdir=/upper/work /merged || fail "cannot mount the root overlay"
mount -t overlay overlay -o lowerdir=/hostusr,upperdir=/upper/usr,workdir=/upper/usrwork /merged/usr || fail "cannot mount the /usr overlay"
mount -t proc proc /merged/proc
mount -t sysfs sys /merged/sys
mount -t devtmpfs dev /merged/dev
mkdir -p /merged/dev/pts /merged/dev/shm
mount -t devpts devpts /merged/dev/pts
mount -t tmpfs tmpfs /merged/dev/shm
mount -t tmpfs -o mode=1777 tmpfs /merged/tmp
mount -t tmpfs -o mode=0755 tmpfs /merged/run

# -- network (issue 13). The 9P shares (10.0.2.100, QEMU guestfwd) are always reachable.
# open: the usual user-networking setup (default route, DNS).
# disabled: QEMU's restrict=on cuts the guest off; /32 addressing and no routes besides.
# allowlist: restrict=on as well: the guest's only egress is the host's proxy
#   (sandbox/vm/netproxy.py, which enforces the list) on 10.0.2.100:3128 (HTTP proxy, CONNECT)
#   and :53 (DNS over TCP). netstub.py adapts guest traffic to it: a DNS stub on 127.0.0.1:53
#   (resolv.conf) and a redirector on 127.0.0.1:3129 that nftables sends all other outgoing TCP
#   to (when the guest root has nft). None of this is a policy: guest root can flush it and
#   still reach nothing but the proxy. The commands' HTTP(S)_PROXY/NO_PROXY come from the host.
ip link set lo up
ip link set eth0 up
if [ "$NET" = open ]; then
  ip addr add 10.0.2.15/24 dev eth0
  ip route add default via 10.0.2.2
  echo "nameserver 10.0.2.3" > /merged/etc/resolv.conf
else
  ip addr add 10.0.2.15/32 dev eth0
  ip route add 10.0.2.100/32 dev eth0
  if [ "$NET" = allowlist ]; then
    ip route add 10.0.2.2/32 dev eth0
    ip route add default via 10.0.2.2  # packets need a route to reach the nat hook; QEMU drops them
    echo "nameserver 127.0.0.1" > /merged/etc/resolv.conf
    mkdir -p /merged/run/sandbox-net
    cp /netstub.py /merged/run/sandbox-net/
    # respawned if it dies (a crash fails closed: no DNS, no redirection; the proxy is still the only way out)
    ( while :; do
        chroot /merged /usr/bin/python3 -I /run/sandbox-net/netstub.py </dev/null
        say "netstub exited ($?); restarting it"
        sleep 1
      done ) &
    if [ -x /merged/usr/sbin/nft ]; then
      chroot /merged /usr/sbin/nft -f - <<NFT || say "cannot install the transparent redirection"
table ip sandbox_redirect {
  chain out {
    type nat hook output priority -100; policy accept;
    ip daddr { 127.0.0.0/8, 10.0.2.100 } return
    meta l4proto tcp redirect to :3129
  }
}
NFT
    else
      echo "sandbox-net: no nft in the guest root: only proxy-aware tools reach the allowlist"
    fi
  fi
fi

# a mount's backing device (/sys/class/bdi/MAJOR:MINOR) from its st_dev (decimal, glibc's encoding)
bdi_name() { echo "$(( ($1 >> 8) & 0xfff )):$(( ($1 & 0xff) | (($1 >> 12) & 0xfff00) ))"; }

# -- the shares: the host's mount table (fw_cfg opt/sandbox/mounts), shallowest first.
# One line per share: PORT ANAME ro|rw TARGET (the target is the rest of the line); a
# virtio-fs share (issue 17, share="virtiofs") is "virtiofs TAG ro|rw TARGET".
MOUNTS=/sys/firmware/qemu_fw_cfg/by_name/opt/sandbox/mounts/raw
: > /mounts
[ -r "$MOUNTS" ] && cat "$MOUNTS" > /mounts
while read -r port aname mode target; do
  [ -n "$port" ] || continue
  if [ "$port" = virtiofs ]; then
    mkdir -p "/merged$target" || fail "cannot make the mount point $target"
    opts=rw
    [ "$mode" = ro ] && opts=ro
    mount -t virtiofs -o "$opts" "$aname" "/merged$target" || fail "cannot mount virtio-fs share $aname at $target"
    # its readahead (control.VIRTIOFS_READ_AHEAD_KB; the kernel's default is 128 KiB)
    if [ -n "$VFS_RA_KB" ]; then
      ra=/sys/class/bdi/$(bdi_name "$(stat -c %d "/merged$target")")/read_ahead_kb
      echo "$VFS_RA_KB" > "$ra" || say "cannot set $ra: the default readahead stays"
    fi
    continue
  fi
  opts="trans=tcp,port=$port,version=9p2000.L,cache=none,msize=$MSIZE,aname=$aname"
  [ "$mode" = ro ] && opts="$opts,ro"
  mkdir -p "/merged$target" || fail "cannot make the mount point $target"
  mount -t 9p -o "$opts" 10.0.2.100 "/merged$target" || fail "cannot mount share $aname at $target"
done < /mounts

# -- the control port (no udev here: find the virtio-serial port named "control")
find_port() {
  for n in /sys/class/virtio-ports/vport*; do
    [ "$(cat "$n/name" 2>/dev/null)" = "$1" ] && { echo "/dev/${n##*/}"; return 0; }
  done
  return 1
}
tries=0
until port=$(find_port control); do  # the name can appear a moment after the device
  tries=$((tries + 1))
  [ "$tries" -gt 100 ] && fail "no virtio-serial port named control"
  sleep 0.1
done
mkdir -p /merged/dev/virtio-ports
ln -sf "$port" /merged/dev/virtio-ports/control
chmod 600 "$port" /merged"$port"
mkdir -p -m 0700 /merged/run/sandbox
chmod 0700 /merged/run/sandbox
cp /shim.py /control.py /merged/run/sandbox/  # the shim imports control.py beside it
chmod 0600 /merged/run/sandbox/shim.py /merged/run/sandbox/control.py

# -- the guest user (issue 13): `agent` (uid/gid from the host: the working folder's owner),
# home in the guest's writable layer. passwd/group (the guest's copies, in the writable layer):
# exactly one `agent` entry with these ids, and no other name for them; idempotent.
case "$AGENT_UID:$AGENT_GID" in
  *[!0-9:]*|0:*|*:0|:*|*:) fail "bad guest user ids $AGENT_UID:$AGENT_GID" ;;
esac
pw="agent:x:$AGENT_UID:$AGENT_GID:sandbox agent:/home/agent:/bin/sh" gr="agent:x:$AGENT_GID:"
if ! grep -qx "$pw" /merged/etc/passwd 2>/dev/null || [ "$(grep -c "^[^:]*:[^:]*:$AGENT_UID:" /merged/etc/passwd)" != 1 ]; then
  sed -i -e '/^agent:/d' -e "/^[^:]*:[^:]*:$AGENT_UID:/d" /merged/etc/passwd 2>/dev/null
  echo "$pw" >> /merged/etc/passwd
fi
if ! grep -qx "$gr" /merged/etc/group 2>/dev/null || [ "$(grep -c "^[^:]*:[^:]*:$AGENT_GID:" /merged/etc/group)" != 1 ]; then
  sed -i -e '/^agent:/d' -e "/^[^:]*:[^:]*:$AGENT_GID:/d" /merged/etc/group 2>/dev/null
  echo "$gr" >> /merged/etc/group
fi
mkdir -p /merged/home/agent
chown "$AGENT_UID:$AGENT_GID" /merged/home/agent && chmod 0700 /merged/home/agent
SHIM_USER="--user $AGENT_UID:$AGENT_GID"
[ "$AS_ROOT" = 1 ] && SHIM_USER=

echo SANDBOX-READY
while true; do
  chroot /merged /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    LANG=C.UTF-8 TERM=dumb /usr/bin/python3 /run/sandbox/shim.py --port /dev/virtio-ports/control $SHIM_USER \
    --undo-events /run/sandbox-undo/events.jsonl  # control.UNDO_EVENTS_PATH (docs/vm.md: undo notifications)
  say "the shim exited ($?); restarting it"
  sleep 1
done
