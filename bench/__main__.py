from bench.app import main

main()
