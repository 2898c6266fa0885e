from llmbus.supervisor.cli import main

main(prog_name="llmbus")
