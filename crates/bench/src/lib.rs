//! `kvferry bench`: real GiB/s and real fetch-versus-recompute decisions against the model,
//! over the userspace WAN emulator (`kvferry-wanem`), with the baselines a user would
//! otherwise pick measured on the same emulated link in the same run.
