C=/sys/fs/cgroup;T=$C/gpubook-probe;P=$(ls /usr/bin/python3 2>/dev/null || command -v python3)
echo '+memory +pids +cpu' > $C/cgroup.subtree_control
mkdir -p $T/daemon
echo '+memory +pids +cpu' > $T/cgroup.subtree_control
chown 4242:4242 $T $T/cgroup.procs $T/cgroup.subtree_control $T/cgroup.threads
chown 4242:4242 $T/daemon $T/daemon/cgroup.procs $T/daemon/cgroup.subtree_control $T/daemon/cgroup.threads
sh -c "echo \$\$ > $T/daemon/cgroup.procs; exec setpriv --reuid 4242 --regid 4242 --clear-groups sh" <<EOS
cd /; id; cat /proc/self/cgroup
B=$T/bookings; mkdir \$B && echo '+memory +pids +cpu' > \$B/cgroup.subtree_control; cat \$B/cgroup.subtree_control
for n in a b; do mkdir \$B/\$n; echo 268435456 > \$B/\$n/memory.max; echo 0 > \$B/\$n/memory.swap.max; echo 50 > \$B/\$n/pids.max; done
sh -c "echo \\\$\\\$ > \$B/a/cgroup.procs; exec $P -c 'b=bytearray(1<<30);b[::4096]=bytes(len(b[::4096]))'"; echo hog=\$?
sh -c "echo \\\$\\\$ > \$B/b/cgroup.procs; exec $P -c 'b=bytearray(64<<20);print(\"fine\",len(b))'"; echo other=\$?
sh -c "echo \\\$\\\$ > \$B/a/cgroup.procs; i=0; while [ \\\$i -lt 100 ]; do sleep 2 & i=\\\$((i+1)); done; wait" 2>&1 | tail -1
grep oom_kill \$B/a/memory.events; grep max \$B/a/pids.events; cat \$B/a/memory.max \$B/a/pids.max
echo root-write: ; echo \$\$ > $C/cgroup.procs && echo ESCAPED || echo refused
EOS
sleep 3; rmdir $T/bookings/a $T/bookings/b $T/bookings $T/daemon $T; echo cleaned=$?
