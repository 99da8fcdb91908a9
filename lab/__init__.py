"""The lab: everything around the method that a student does not need to read to follow it.

The core (medusa_mini.py, verify.py, tree.py, the drafters and the bases, at the project's root) is the
method. The lab trains, measures and reports on it: run settings (config), checkpoints, the training
loop, the drafter registry (drafters), both bases' pipelines, tree choice, timing, the report and the
probes (ops per step, where a step's time goes, the exact-sampling ceiling, the distribution test).
The commands at the root parse flags, call the lab, print and save. The lab imports the core and
never a command, nor the course kit (kit/).
"""
