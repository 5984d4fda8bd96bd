#!/bin/sh
# Hydra's stand-in for ssh in the emulated cluster (benchmarks/cluster.py). mpiexec calls it as
#     netns_launcher.sh [ssh options] HOST COMMAND...
# where HOST is a node's network namespace and COMMAND a shell command line (as ssh passes it on). It runs COMMAND
# in that namespace, in a UTS namespace of its own with the node's host name (/etc/netns/HOST/hostname, which
# `ip netns exec` mounts over /etc/hostname, as it mounts the node's hosts file over /etc/hosts).
while [ $# -gt 0 ]; do
    case $1 in
        -*) shift ;;
        *) break ;;
    esac
done
host=$1
shift
case $host in
    mpiemu-*-n[0-9]*) ;;
    *) echo "netns_launcher.sh: '$host' is not a node of an emulated cluster" >&2; exit 255 ;;
esac
exec ip netns exec "$host" unshare --uts sh -c 'cat /etc/hostname > /proc/sys/kernel/hostname && exec sh -c "$1"' \
    sh "$*"
