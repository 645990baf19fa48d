from compressor.cli import main

main()
