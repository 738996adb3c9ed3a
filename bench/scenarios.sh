# Issue 6's test-bed scenarios, shared by bench/topology.sh and bench/sim-validate.sh
# (sourced, not run).

# scenario -> "rates(Gbit/s, comma-separated) ranks-per-host"
spec() {
    case $1 in
    a) echo "1,1,1,1 1" ;;
    b) echo "1,1 2" ;;
    c) echo "1,1,1,0.25 1" ;;
    d) echo "2,1,1,0.5 1" ;;
    e) echo "0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5 1" ;;
    *)
        echo "unknown scenario $1 (a, b, c, d, e)" >&2
        exit 2
        ;;
    esac
}

# The runtime's topology file of a bed: one [[hosts]] per link, ranks in host order. With a
# 4th argument (a file of "rate efficiency" lines), each host also gets its link_efficiency.
topo_file() {
    local rates=$1 rph=$2 out=$3 effs=${4:-} h=0 r=0
    : >"$out"
    for rate in ${rates//,/ }; do
        local ranks=""
        for ((i = 0; i < rph; i++)); do
            ranks+="${ranks:+, }$r"
            r=$((r + 1))
        done
        printf '[[hosts]]\nname = "h%d"\nranks = [%s]\nlink_gbps = %s\n' "$h" "$ranks" "$rate" >>"$out"
        if [ -n "$effs" ]; then
            awk -v r="$rate" '$1 == r { printf "link_efficiency = %s\n", $2 }' "$effs" >>"$out"
        fi
        h=$((h + 1))
    done
}
