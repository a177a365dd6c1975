#!/bin/busybox sh
# /init of the `cargo xtask vm-test` and `cargo xtask kernels` guests: loads the 9p modules, mounts the host's root read-write
# at /mnt (so the workspace, its target directory and the toolchain are at their host paths), gives
# it the guest's own /proc, /sys, /dev and an empty tmpfs at /dev/shm (TMPDIR: unix sockets and
# fanotify need a local filesystem), runs the script named by `vmtest=` on the kernel command line
# inside it, and powers off. The script records its own results on the host.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
# Loopback, as on any host: tests scrape the agent's metrics on 127.0.0.1.
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# Module dependencies in load order are not known here; three passes settle them.
for pass in 1 2 3; do
    for module in /modules/*.ko; do
        name=$(basename "$module" .ko)
        [ -e "/sys/module/$name" ] || insmod "$module" 2>/dev/null
    done
done
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose hostroot /mnt; then
    echo "vm-test: cannot mount the host's root over 9p"
    poweroff -f
fi
for dir in proc sys dev; do
    mount --bind "/$dir" "/mnt/$dir"
done
mkdir -p /mnt/dev/shm
mount -t tmpfs tmpfs /mnt/dev/shm
mount -t bpf bpf /mnt/sys/fs/bpf
mount -t tracefs tracefs /mnt/sys/kernel/tracing
# cgroup v2, as on a node: the eBPF records name their caller's cgroup by its directory's inode.
mount -t cgroup2 cgroup2 /mnt/sys/fs/cgroup || echo "vm-test: cannot mount cgroup2"
script=$(sed -n 's/.* vmtest=\([^ ]*\).*/\1/p' /proc/cmdline)
# A guest of another architecture than the host names its own shell (busybox) in the host's tree.
shell=$(sed -n 's/.* vmshell=\([^ ]*\).*/\1/p' /proc/cmdline)
mount -t securityfs securityfs /mnt/sys/kernel/security
echo "vm-test: kernel $(uname -r), $(nproc) CPUs, LSMs $(cat /mnt/sys/kernel/security/lsm), running $script"
if [ -n "$shell" ]; then
    chroot /mnt "$shell" sh "$script"
else
    chroot /mnt /bin/sh "$script"
fi
poweroff -f
