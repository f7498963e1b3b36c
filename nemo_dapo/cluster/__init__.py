"""Ray on loopback (or an existing cluster), placement groups and worker groups."""
