"""The Hydra configs of ``mpistrategy-train``, found as ``pkg://mpistrategy.conf`` (this folder is installed as the
package :mod:`mpistrategy.conf`)."""
