"""The fault drill of tools/fault_drill.py (issue 24): real trainer processes, killed, corrupted, starved
of disk and restarted, each followed by the `--resume` a user would type.

processes.py starts, watches and kills the trainer; reading.py reads what a run said and left; one
module a part: kill_during_save.py, corruption.py (with damage.py, the ways a checkpoint is damaged),
other_run.py (another run's checkpoint in a run's out_dir), disk_full.py, restarts.py. Each part's
`run_part(workspace, args)` returns its trials and a tally.
"""
