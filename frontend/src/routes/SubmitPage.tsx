import { useState, type FormEvent, type ReactNode } from 'react'
import { useNavigate } from 'react-router'
import { ApiError } from '../api/client'
import { fieldErrors, submitJob, type JobCreate } from '../api/jobs'
import { parseEnv, splitCommand } from '../components/ui/format'
import { PRIORITIES } from './JobsPage'

const JOB_TYPES = ['command', 'torch', 'hfreduce']

function Field({ id, label, error, children }: { id: string; label: string; error?: string; children: ReactNode }) {
  return (
    <div className={`field${error ? ' invalid' : ''}`}>
      <label htmlFor={id}>{label}</label>
      {children}
      {error && <span className="field-error error" id={`${id}-error`} role="alert">{error}</span>}
    </div>
  )
}

export default function SubmitPage() {
  const navigate = useNavigate()
  const [form, setForm] = useState({ name: '', command: '', nodes: '1', gpus: '8', priority: 'NORMAL', jobType: 'command', env: '' })
  const [errors, setErrors] = useState<Record<string, string>>({})
  const [busy, setBusy] = useState(false)
  const set = (k: keyof typeof form) => (e: { target: { value: string } }) => setForm({ ...form, [k]: e.target.value })

  async function submit(e: FormEvent) {
    e.preventDefault()
    const env = parseEnv(form.env)
    if ('error' in env) {
      setErrors({ env: env.error })
      return
    }
    const body = {
      name: form.name,
      command: splitCommand(form.command),
      nodes: Number(form.nodes),
      gpus_per_node: Number(form.gpus),
      priority: form.priority,
      job_type: form.jobType,
      env: env.env,
    } as JobCreate
    setBusy(true)
    try {
      const job = await submitJob(body)
      navigate(`/jobs/${job.id}`)
    } catch (err) {
      if (err instanceof ApiError && err.status === 422) setErrors(fieldErrors(err.detail))
      else setErrors({ body: err instanceof Error ? err.message : String(err) })
    } finally {
      setBusy(false)
    }
  }

  const aria = (id: string, key: string) => (errors[key] ? { 'aria-invalid': true, 'aria-describedby': `${id}-error` } : {})
  return (
    <section>
      <h2>Submit a job</h2>
      <form className="submit-form" onSubmit={submit} noValidate>
        <Field id="f-name" label="Name" error={errors.name}>
          <input id="f-name" value={form.name} onChange={set('name')} {...aria('f-name', 'name')} />
        </Field>
        <Field id="f-command" label="Command" error={errors.command}>
          <input id="f-command" value={form.command} onChange={set('command')} placeholder="python train.py --epochs 3" {...aria('f-command', 'command')} />
        </Field>
        <Field id="f-nodes" label="Nodes" error={errors.nodes}>
          <input id="f-nodes" type="number" value={form.nodes} onChange={set('nodes')} {...aria('f-nodes', 'nodes')} />
        </Field>
        <Field id="f-gpus" label="GPUs per node" error={errors.gpus_per_node}>
          <input id="f-gpus" type="number" value={form.gpus} onChange={set('gpus')} {...aria('f-gpus', 'gpus_per_node')} />
        </Field>
        <Field id="f-priority" label="Priority" error={errors.priority}>
          <select id="f-priority" value={form.priority} onChange={set('priority')}>
            {PRIORITIES.map((p) => <option key={p} value={p}>{p}</option>)}
          </select>
        </Field>
        <Field id="f-type" label="Job type" error={errors.job_type}>
          <select id="f-type" value={form.jobType} onChange={set('jobType')}>
            {JOB_TYPES.map((t) => <option key={t} value={t}>{t}</option>)}
          </select>
        </Field>
        <Field id="f-env" label="Environment" error={errors.env}>
          <textarea id="f-env" rows={4} value={form.env} onChange={set('env')} placeholder={'KEY=VALUE\nOTHER=1'} {...aria('f-env', 'env')} />
        </Field>
        {errors.body && <p className="error" role="alert">{errors.body}</p>}
        <button type="submit" disabled={busy}>Submit</button>
      </form>
    </section>
  )
}
