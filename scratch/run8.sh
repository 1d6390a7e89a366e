export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++ MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
R=$PWD; cd /tmp
ncu --kernel-name regex:implicit_embed_kernel_sm90 --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats python3 $R/scratch/ncu_case.py > $OUT/ncu_p5.txt 2>&1
ncu --kernel-name regex:implicit_embed_kernel_sm90 --launch-skip 3 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats python3 $R/scratch/ncu_case.py > $OUT/ncu_p1.txt 2>&1
grep -E "Duration|Throughput|L2|L1|Issue|Stall|Eligible|Active Warps|Hit Rate|Bandwidth|Busy" $OUT/ncu_p5.txt | head -40
echo ----
grep -E "Duration|Throughput|L2|Issue|Eligible|Hit Rate|Busy" $OUT/ncu_p1.txt | head -30
