"""The stats sink's record of engine steps (no engine: the sink is fed as vLLM's output
handler feeds it)."""

from types import SimpleNamespace

from rollq.consumer._vllm_stats import StatsSink


def test_steps_seen_and_their_gaps_cover_only_the_window_asked_for():
    sink = StatsSink()
    sink.step_times.extend([1.0, 1.01, 1.02, 1.06, 1.07, 2.0])
    assert sink.steps_seen(1.01, 1.07) == [1.01, 1.02, 1.06, 1.07]
    gaps = sink.step_gaps(1.01, 1.07)
    assert [round(g, 3) for g in gaps] == [0.01, 0.04, 0.01]
    longest = max(zip(gaps, sink.steps_seen(1.01, 1.07)))
    assert longest == (gaps[1], 1.02)  # the longest gap began at the step seen at 1.02


def test_a_step_is_recorded_when_its_iteration_stats_arrive():
    sink = StatsSink()
    sink.record(0, None, SimpleNamespace(num_generation_tokens=3, num_prompt_tokens=0, num_preempted_reqs=0,
                                         finished_requests=()))
    sink.record(0, SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0), None)
    assert len(sink.steps_seen(0.0)) == 1 and sink.generated_tokens == 3
