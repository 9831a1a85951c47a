from benchmarks.bench import main

main()
