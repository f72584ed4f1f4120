#!/bin/bash
# Bisect one check of the GPU proof between two commits, on the GPU machine, in one device call.
#
# The device machine gets a copy of the working tree, not its history, so ship the history as a
# bundle first (an untracked file travels with the tree), then run this script there:
#
#   git bundle create gpu-bisect.bundle --all                      # here, before the device call
#   bash benchmarks/gpu_bisect.sh GOOD BAD "cap native" batchfit   # there; GOOD passed, BAD failed
#
# Each step runs `benchmarks/gpu.py --part 1 --only CHECK` of that commit (its own proof, about
# 40-55 s for "cap native") and reads PASS as good, FAIL as bad, anything else as skip. `--deadline
# 85`: before the one-call proof no check started after it; since, every process has ended by it.
# The last argument limits the bisection to commits touching that path. Delete the bundle afterwards.
set -u
good=$1 bad=$2 check=$3 path=${4:-batchfit}
bundle=$(pwd)/gpu-bisect.bundle
work=$(mktemp -d)
git clone -q "$bundle" "$work/repo" && cd "$work/repo" && git checkout -q "$bad"
cat > "$work/step.sh" <<STEP
#!/bin/bash
c=\$(git rev-parse --short HEAD)
line=\$(timeout 90 python3 benchmarks/gpu.py --part 1 --only "$check" --deadline 85 --out "$work/out-\$c" 2>&1 \
  | grep -E "^\[.*\] $check: " | tail -1)
echo "STEP \$c \$(git log -1 --format=%s | cut -c1-60) :: \$line"
case "\$line" in *"$check: PASS"*) exit 0;; *"$check: FAIL"*) exit 1;; *) exit 125;; esac
STEP
chmod +x "$work/step.sh"
git bisect start "$bad" "$good" -- "$path" > /dev/null
git bisect run "$work/step.sh" 2>&1 | grep -E "^STEP|is the first bad commit" 
git bisect log | tail -3
